"""When the supervisor restarts a dead worker, and how a crash loop shows.

Each worker slot (index 0..N-1) has its own `SlotHistory`:

* Backoff. A dead worker is restarted after a delay that starts at
  RESTART_DELAY_MIN_S and doubles with each death, up to RESTART_DELAY_MAX_S,
  so a worker that dies at once (a broken dataset, a bad host) costs a few
  spawns a minute, not a core. Once a worker has stayed up
  RESTART_STABLE_AFTER_S, its slot counts as healthy again and the next death
  starts over at the minimum.
* Crash loop. A slot whose worker died more than CRASH_LOOP_RESTARTS times in
  a row, each time before it had stayed up RESTART_STABLE_AFTER_S, is
  crash-looping: the window is the unstable stretch since the slot was last
  healthy, however long the backoff has grown. The loop ends when a worker of
  that slot has stayed up RESTART_STABLE_AFTER_S.
* A death the supervisor blames on a step (a record that crashes the
  pipeline: step_board.py), which every worker refuses from then on, is
  no trouble of the slot's: it neither lengthens the delay nor counts
  toward a crash loop.

`CrashLoopFlag` carries the number of crash-looping slots from the supervisor
to its workers, which report NOT_SERVING on their health service while it is
not zero (worker.run).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

# First restart delay of a slot, and the most the doubling reaches.
RESTART_DELAY_MIN_S = 0.5
RESTART_DELAY_MAX_S = 30.0
# Uptime after which a worker counts as healthy: its slot's delay starts over
# and a crash loop of that slot ends.
RESTART_STABLE_AFTER_S = 60.0
# More deaths in a row than this, none after a healthy run: a crash loop.
CRASH_LOOP_RESTARTS = 3
# How often a worker looks at the crash-loop flag.
CRASH_LOOP_POLL_S = 0.5


@dataclasses.dataclass
class SlotHistory:
  """One worker slot's restarts; times are time.monotonic() seconds."""
  delay_s: float = RESTART_DELAY_MIN_S  # the wait before the next restart
  deaths: int = 0                       # deaths in a row since it was healthy
  started_at: float | None = None       # when its current worker was spawned
  crash_loop: bool = False

  def started(self, now: float) -> None:
    self.started_at = now

  def died(self, now: float, explained: bool = False) -> float:
    """Records a death; returns how long to wait before the restart.
    `explained`: the death is a step's, refused from now on
    (step_board.py): it waits the slot's delay, which it leaves as it is,
    and counts toward no crash loop."""
    self.stable(now)  # a worker that was up long enough resets the slot first
    self.started_at = None
    if explained:
      return self.delay_s
    self.deaths += 1
    self.crash_loop = self.crash_loop or self.deaths > CRASH_LOOP_RESTARTS
    delay, self.delay_s = self.delay_s, min(self.delay_s * 2, RESTART_DELAY_MAX_S)
    return delay

  def stable(self, now: float) -> bool:
    """Resets the slot if its worker has been up RESTART_STABLE_AFTER_S;
    True when that ended a crash loop."""
    if self.started_at is None or now - self.started_at < RESTART_STABLE_AFTER_S:
      return False
    ended = self.crash_loop
    self.delay_s, self.deaths, self.crash_loop = RESTART_DELAY_MIN_S, 0, False
    return ended


class CrashLoopFlag:
  """How many slots are crash-looping: written by the supervisor, read by its
  workers. Shared memory without a lock: a worker killed while reading it
  must not leave a lock held, and one int needs none."""

  def __init__(self, ctx: Any):
    self._count = ctx.RawValue("i", 0)

  def set(self, count: int) -> None:
    self._count.value = count

  def get(self) -> int:
    return self._count.value

  def watch(self, on_change: Callable[[bool], None], stop: threading.Event) -> None:
    """Calls on_change(looping) now if a crash loop is on, then from a daemon
    thread whenever that changes, until `stop`."""
    looping = self.get() > 0
    if looping:
      on_change(True)

    def poll() -> None:
      nonlocal looping
      while not stop.wait(CRASH_LOOP_POLL_S):
        now = self.get() > 0
        if now != looping:
          looping = now
          on_change(now)
    threading.Thread(target=poll, daemon=True, name="elevator-crash-loop").start()
