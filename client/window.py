"""How many steps a default client keeps in flight, and how many it asks for
in one request, from the size of a step.

Users run defaults, so the defaults are derived rather than fixed. A request
costs a round trip, a thread hand-off and the server's pipeline start
whatever its size, so it should carry about `REQUEST_BYTES` (3-4 steps of a
3-5 MB batch; dozens of small ones). Every connection should have a request
in flight while the trainer works, so the window is one request per
connection, but never more than `WINDOW_BYTES`, so a trainer with 100 MB
steps does not hold gigabytes of them. Measured against hand-tuned settings
in BENCHMARKS.md ("Default client against tuned").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grain_elevator.proto.limits import LONG_STREAM_STEPS

# About what one request should carry. 12 MB gives 4 steps of the bench's
# 3.1 MB "small" batch and 3 of its 4.9 MB "large" one: the settings that
# were fastest when tuned by hand on both.
REQUEST_BYTES = 12 << 20
# The most the default window holds (received and not yet taken, or coming).
WINDOW_BYTES = 256 << 20
# Well under a long stream (proto/limits.py), which servers admit fewer of.
MAX_STEPS_PER_REQUEST = LONG_STREAM_STEPS // 2


@dataclasses.dataclass(frozen=True)
class Window:
  """Steps kept in flight (0: fetch on demand) and steps per request."""

  prefetch: int
  steps_per_request: int


def plan(step_bytes: int, connections: int, *, prefetch: int | None = None,
         steps_per_request: int | None = None) -> Window:
  """The window for steps of `step_bytes` over `connections` connections in
  all; a value the user gave is kept as given."""
  step_bytes = max(1, step_bytes)
  if steps_per_request is None:
    steps_per_request = min(MAX_STEPS_PER_REQUEST, max(1, -(-REQUEST_BYTES // step_bytes)))
    if prefetch is not None:  # a request larger than the window would never be sent whole
      steps_per_request = max(1, min(steps_per_request, prefetch))
  if prefetch is None:
    prefetch = min(max(1, connections) * steps_per_request,
                   max(steps_per_request, WINDOW_BYTES // step_bytes))
  return Window(prefetch, steps_per_request)


def for_dataset(ds: Any, record_bytes: int) -> Window:
  """The window of an iterator of RemoteDataset `ds`, whose records are
  `record_bytes` each: over every connection to its targets."""
  return plan(ds.global_batch_size // ds.shard_count * record_bytes,
              len(ds.targets) * ds.transport.connections_per_target, prefetch=ds.prefetch,
              steps_per_request=ds.transport.steps_per_request)
