"""A stream dataset's fetch thread (client/stream_iterator.py): whatever
ends it that the trainer did not ask for reaches the trainer as an error,
never as a `next()` that waits forever."""

from __future__ import annotations

import pytest

from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.client.stream_iterator import StreamIterator
from grain_elevator.proto.errors import Cancelled
from fake_backend import read_spec


class _CancelledAfterFirstChunk:
  """Embedded mode, whose second fetch ends in a Cancelled nobody asked for
  (as a transport's own cancellation would surface)."""

  uses_bulk = False
  retries = fallbacks = 0

  def __init__(self, config_path: str):
    self._real = EmbeddedBackend(config_path)
    self.targets = self._real.targets
    self.fetches = 0

  def describe(self, *args, **kwargs):
    return self._real.describe(*args, **kwargs)

  def fetch(self, request, token=None, out=None):
    self.fetches += 1
    if self.fetches > 1:
      raise Cancelled("the stream was cancelled under the client")
    return self._real.fetch(request, token, out)

  def close(self) -> None:
    self._real.close()


@pytest.mark.timeout(60)
def test_a_cancelled_fetch_the_trainer_did_not_ask_for_is_raised(few_config):
  backend = _CancelledAfterFirstChunk(few_config)
  (info,) = backend.describe("few", 8)
  it = StreamIterator(read_spec(info, 8, prefetch=2), backend)
  with pytest.raises(Cancelled, match="cancelled under the client"):
    for _ in range(10_000):
      next(it)
  it.close()
