"""How many steps a default client keeps in flight, and how many it asks for
in one request: sized from the step and the servers' workers, then adapted
to the trainer.

Users run defaults, so the defaults are derived rather than fixed. A request
costs a round trip, a thread hand-off and the server's pipeline start
whatever its size, so it should carry about `REQUEST_BYTES` (3-4 steps of a
3-5 MB batch; dozens of small ones), unless that is more than a short time
of a worker's work (client/request_size.py picks the size; this plans the
window around it). Every server worker should have
`REQUESTS_PER_WORKER` requests in flight (one being produced while the
other's batch is sent), so the window starts at one request per connection
carrying batches, which a default client opens at that many per worker of
every replica (client/transport/pool.py); and never holds more than
`WINDOW_BYTES`, so a trainer with 100 MB steps does not hold gigabytes of
them. Where the bound cannot hold a request of `REQUEST_BYTES` for every
worker, requests get smaller rather than workers idle.

The window then follows the trainer, as tf.data's AUTOTUNE does (`Autotune`):
it grows while the trainer waits for steps, up to `GROWTH` times its start
(within the bound), and shrinks while whole requests' worth of steps sit
received and untaken. Only how far ahead the client fetches changes, never
which steps it delivers or in what order. Measured against hand-tuned
settings in BENCHMARKS.md ("A default client against the tuned one").
"""

from __future__ import annotations

import dataclasses

from grain_elevator.client.read_spec import ReadSpec
# The window's bound in bytes and its requests per server worker are
# defaults the pool sizes itself by too, so they live beside it.
from grain_elevator.client.transport.options import REQUESTS_PER_WORKER, WINDOW_BYTES
from grain_elevator.proto.limits import LONG_STREAM_STEPS

# About what one request should carry. 12 MB gives 4 steps of the bench's
# 3.1 MB "small" batch and 3 of its 4.9 MB "large" one: the settings that
# were fastest when tuned by hand on both.
REQUEST_BYTES = 12 << 20
# Well under a long stream (proto/limits.py), which servers admit fewer of.
MAX_STEPS_PER_REQUEST = LONG_STREAM_STEPS // 2
# How far the adaptive window may grow past its start: requests queued
# behind busy connections go out the moment one frees, whichever request
# the trainer is waiting on. Twice the start is 4 requests per worker, a
# quarter of a worker's slots (`elevator serve --max-concurrent-requests`).
GROWTH = 2
# Embedded mode has no server workers: fetch threads run the pipeline in the
# trainer's process. As many requests as the fixed default had connections.
EMBEDDED_REQUESTS = 4
# A stream dataset's requests go one after another (client/stream_iterator.py),
# so more connections or a wider window do not make it faster: it fetches
# this many requests' worth of steps ahead, to ride out a slow one.
STREAM_REQUESTS = 4
# The window shrinks by a request only after this many periods in a row
# with at least two requests' worth of steps received and untaken: growing
# is quick, shrinking slow, so it does not oscillate.
CALM_PERIODS = 2


@dataclasses.dataclass(frozen=True)
class Window:
  """Steps kept in flight (0: fetch on demand), steps per request, and the
  most the window may grow to (`Autotune`; == prefetch when it is fixed)."""

  prefetch: int
  steps_per_request: int
  most: int = 0
  adaptive: bool = False


def plan(step_bytes: int, requests: int, *, prefetch: int | None = None,
         steps_per_request: int | None = None, window_bytes: int = WINDOW_BYTES,
         adaptive: bool = True) -> Window:
  """The window for steps of `step_bytes` with `requests` requests in flight
  keeping every worker busy (one per connection carrying batches); a value
  the user gave is kept as given, and a window the user gave is fixed."""
  step_bytes = max(1, step_bytes)
  requests = max(1, requests)
  budget = max(1, window_bytes // step_bytes)  # steps the memory bound holds
  if steps_per_request is None:
    steps_per_request = min(MAX_STEPS_PER_REQUEST, max(1, -(-REQUEST_BYTES // step_bytes)))
    if prefetch is not None:  # a request larger than the window would never be sent whole
      steps_per_request = max(1, min(steps_per_request, prefetch))
    else:  # smaller requests rather than workers without one
      steps_per_request = max(1, min(steps_per_request, budget // requests))
  if prefetch is not None:
    return Window(prefetch, steps_per_request, prefetch, adaptive=False)
  cap = max(steps_per_request, budget)  # a step over the whole bound still goes, alone
  start = min(requests * steps_per_request, cap)
  most = min(GROWTH * requests * steps_per_request, cap) if adaptive else start
  return Window(start, steps_per_request, most, adaptive=adaptive)


def for_dataset(spec: ReadSpec, requests: int, *, adaptive: bool = True,
                steps_per_request: int | None = None) -> Window:
  """The window of an iterator reading `spec` (described) with `requests`
  in flight, which keep every worker busy (a stream's reader asks for
  STREAM_REQUESTS, fixed: `adaptive` False); the options the trainer gave
  are kept. `steps_per_request`: the size the reader chose
  (client/request_size.py), where the trainer gave none."""
  step_bytes = (spec.global_batch_size // spec.shard_count
                * spec.require_info().element_spec.record_bytes)
  return plan(step_bytes, requests, prefetch=spec.prefetch,
              steps_per_request=spec.transport.steps_per_request or steps_per_request,
              window_bytes=spec.window_bytes, adaptive=adaptive)


class Autotune:
  """The window while the trainer runs: grows while the trainer waits,
  shrinks while steps pile up, within [one request, `Window.most`].

  The iterator reports each step it delivers (`observe`): whether the
  trainer had to wait for it, and how many steps had arrived untaken. Over a
  period of one window's worth of steps: any wait grows the window by a
  quarter (at least a request); none, with two requests' worth of steps
  always ready, for CALM_PERIODS periods in a row shrinks it by one request.
  The steps of the first window after a start or a `set_state` are not
  counted: they were all asked for at once, so the trainer waits on their
  latency, not on the tier's rate. Deterministic in its inputs (no clock).
  """

  def __init__(self, window: Window):
    self.resize(window)

  def resize(self, window: Window) -> None:
    """Starts over at `window` (its requests changed size:
    client/request_size.py)."""
    self.prefetch = window.prefetch
    self._unit = window.steps_per_request
    self._low = min(window.prefetch, self._unit)
    self._most = max(window.most, window.prefetch)
    self._calm = 0
    self.restart()

  def restart(self) -> None:
    """A new start (set_state): the next window's steps are warm-up."""
    self._skip = self.prefetch
    self._seen = self._waits = 0
    self._min_ready: int | None = None

  def observe(self, waited: bool, ready: int) -> None:
    """A step was delivered: `waited`, the trainer blocked for it; `ready`,
    steps received and not yet taken when it asked (the step included)."""
    if self._skip > 0:
      self._skip -= 1
      return
    self._seen += 1
    self._waits += waited
    self._min_ready = ready if self._min_ready is None else min(self._min_ready, ready)
    if self._seen < max(self.prefetch, 2 * self._unit):
      return
    if self._waits:
      self._calm = 0
      if self.prefetch < self._most:
        grow = max(self._unit, self.prefetch // 4 // self._unit * self._unit)
        self.prefetch = min(self._most, self.prefetch + grow)
    elif (self._min_ready or 0) >= 2 * self._unit and self.prefetch > self._low:
      self._calm += 1
      if self._calm >= CALM_PERIODS:
        self._calm = 0
        self.prefetch = max(self._low, self.prefetch - self._unit)
    else:
      self._calm = 0
    self._seen = self._waits = 0
    self._min_ready = None
