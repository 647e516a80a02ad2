"""A default client's window is sized from the step: about 12 MB per request,
one request per connection, at most 256 MB in flight."""

from __future__ import annotations

import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.client.window import (MAX_STEPS_PER_REQUEST, REQUEST_BYTES, WINDOW_BYTES,
                                          Window, plan)

MB = 1 << 20


@pytest.mark.parametrize("step_bytes, steps, prefetch", [
    (3 * MB, 4, 16),  # elevator bench's small workload: its hand-tuned setting
    (int(4.9 * MB), 3, 12),  # and its large one
    (100 << 10, MAX_STEPS_PER_REQUEST, 4 * MAX_STEPS_PER_REQUEST),  # small steps: capped
    (100 * MB, 1, 2),  # huge steps: one per request, the window under 256 MB
    (1 << 30, 1, 1),  # a step over the whole budget still goes, one at a time
])
def test_defaults_follow_the_step_size(step_bytes, steps, prefetch):
  window = plan(step_bytes, connections=4)
  assert window == Window(prefetch, steps)
  assert window.steps_per_request * step_bytes >= min(REQUEST_BYTES, step_bytes)
  assert window.prefetch * step_bytes <= max(WINDOW_BYTES, step_bytes)


def test_what_the_user_sets_is_kept():
  assert plan(3 * MB, 4, prefetch=0) == Window(0, 1)  # on demand: one step at a time
  assert plan(3 * MB, 4, prefetch=2) == Window(2, 2)  # a request never exceeds the window
  assert plan(3 * MB, 4, steps_per_request=1) == Window(4, 1)
  assert plan(3 * MB, 4, prefetch=32, steps_per_request=8) == Window(32, 8)


def test_more_connections_more_in_flight():
  assert plan(3 * MB, 8).prefetch == 2 * plan(3 * MB, 4).prefetch


def test_a_default_client_reads_the_same_stream_as_one_step_requests(server, config_path):
  """The sized window changes how steps are asked for, never which."""
  with RemoteDataset(server.target, "aug2", 48) as default, \
       RemoteDataset.embedded(config_path, "aug2", 48) as local:
    from helpers import assert_streams_equal  # pylint: disable=import-outside-toplevel
    assert assert_streams_equal(default, local) == 2 * 1000 // 48
