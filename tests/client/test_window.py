"""A default client's window is sized from the step and the servers'
workers: about 12 MB per request, one request per connection (two per
worker), at most WINDOW_BYTES (512 MB) in flight; then it adapts to the trainer."""

from __future__ import annotations

import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.client.window import (CALM_PERIODS, GROWTH, MAX_STEPS_PER_REQUEST,
                                          REQUEST_BYTES, WINDOW_BYTES, Autotune, Window,
                                          plan)

MB = 1 << 20


@pytest.mark.parametrize("step_bytes, steps, prefetch", [
    (3 * MB, 4, 16),  # elevator bench's small workload: its hand-tuned setting
    (int(4.9 * MB), 3, 12),  # and its large one
    (100 << 10, MAX_STEPS_PER_REQUEST, 4 * MAX_STEPS_PER_REQUEST),  # small steps: capped
    (100 * MB, 1, 4),  # huge steps: one per request, the window under 512 MB
    (1 << 30, 1, 1),  # a step over the whole budget still goes, one at a time
])
def test_defaults_follow_the_step_size(step_bytes, steps, prefetch):
  window = plan(step_bytes, requests=4)
  assert (window.prefetch, window.steps_per_request) == (prefetch, steps)
  assert window.adaptive and prefetch <= window.most <= GROWTH * prefetch
  assert window.steps_per_request * step_bytes >= min(REQUEST_BYTES, step_bytes)
  assert window.most * step_bytes <= max(WINDOW_BYTES, step_bytes)


def test_what_the_user_sets_is_kept():
  assert plan(3 * MB, 4, prefetch=0) == Window(0, 1, 0)  # on demand: one step at a time
  assert plan(3 * MB, 4, prefetch=2) == Window(2, 2, 2)  # a request never exceeds the window
  assert plan(3 * MB, 4, steps_per_request=1) == Window(4, 1, 8, adaptive=True)
  assert plan(3 * MB, 4, prefetch=32, steps_per_request=8) == Window(32, 8, 32)


def test_more_workers_more_in_flight():
  assert plan(3 * MB, 8).prefetch == 2 * plan(3 * MB, 4).prefetch


def test_many_workers_get_smaller_requests_within_the_bound():
  """16 workers x 2 requests of the large workload's 4.9 MB steps fit the
  default bound at 3 steps each, but not 256 MB: one step each there, every
  worker still fed."""
  step = int(4.9 * MB)
  assert plan(step, requests=32) == Window(96, 3, WINDOW_BYTES // step, adaptive=True)
  window = plan(step, requests=32, window_bytes=256 * MB)
  assert window == Window(32, 1, 256 * MB // step, adaptive=True)
  assert plan(step, requests=32, window_bytes=1 << 30) == Window(96, 3, 192, adaptive=True)


def _drive(tune: Autotune, steps: int, *, waited: bool, ready: int) -> list[int]:
  seen = []
  for _ in range(steps):
    tune.observe(waited, ready)
    seen.append(tune.prefetch)
  return seen


def test_the_window_grows_while_the_trainer_waits_up_to_its_most():
  tune = Autotune(Window(16, 4, 32, adaptive=True))
  seen = _drive(tune, 16, waited=True, ready=0)  # the first window: warm-up, not counted
  assert set(seen) == {16}
  seen = _drive(tune, 200, waited=True, ready=0)
  assert seen[15] == 20 and max(seen) == seen[-1] == 32  # a quarter at a time, then the cap
  assert seen == sorted(seen)


def test_the_window_shrinks_slowly_while_steps_pile_up_and_holds_between():
  tune = Autotune(Window(16, 4, 32, adaptive=True))
  _drive(tune, 16, waited=False, ready=16)  # warm-up
  seen = _drive(tune, 16 * CALM_PERIODS, waited=False, ready=16)
  assert seen[-1] == 12 and set(seen[:-1]) == {16}  # one request, after CALM_PERIODS periods
  seen = _drive(tune, 400, waited=False, ready=16)
  assert seen[-1] == 4  # down to one request while whole requests stay ready
  # Between the two: no wait, under two requests ready: it holds.
  tune = Autotune(Window(16, 4, 32, adaptive=True))
  assert set(_drive(tune, 400, waited=False, ready=7)) == {16}


def test_one_wait_breaks_a_calm_spell():
  tune = Autotune(Window(16, 4, 32, adaptive=True))
  _drive(tune, 16 + 16, waited=False, ready=16)  # warm-up, one calm period
  _drive(tune, 15, waited=False, ready=16)
  _drive(tune, 1, waited=True, ready=0)
  assert tune.prefetch == 20  # grew, not shrank


def test_a_restart_is_warm_up_again():
  tune = Autotune(Window(16, 4, 32, adaptive=True))
  _drive(tune, 40, waited=True, ready=0)
  grown = tune.prefetch
  tune.restart()
  assert set(_drive(tune, grown, waited=True, ready=0)) == {grown}


def test_a_default_client_reads_the_same_stream_as_one_step_requests(server, config_path):
  """The sized window changes how steps are asked for, never which."""
  with RemoteDataset(server.target, "aug2", 48) as default, \
       RemoteDataset.embedded(config_path, "aug2", 48) as local:
    from helpers import assert_streams_equal  # pylint: disable=import-outside-toplevel
    assert assert_streams_equal(default, local) == 2 * 1000 // 48
