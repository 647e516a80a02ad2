"""How many reads may be in flight: a gate whose limit moves, and one per
prefix that backs off when the store says it is asked too fast.

S3 answers 503 SlowDown past ~5,500 GETs/s per prefix, GCS 429 past ~5,000
reads/s per bucket at first (both raise their limits over tens of minutes).
A reader that retries at the same depth keeps hitting the limit; one that
halves its depth at each refusal and adds one request per window of
successes (additive increase, multiplicative decrease, as TCP does) settles
just under it. The per-prefix window starts unlimited: only a store that
refuses ever sees it.
"""

from __future__ import annotations

import asyncio
import collections
import time

# A prefix's window never falls below this many requests in flight.
MIN_WINDOW = 4
# Refusals within this long of a cut are one event (they were all in flight
# at the depth that was cut): the window is halved once per round trip.
CUT_INTERVAL_S = 0.2


class Gate:
  """An asyncio semaphore with a limit that can change. Loop thread only."""

  def __init__(self, limit: float) -> None:
    self.limit = limit
    self.held = 0
    self._waiters: collections.deque[asyncio.Future] = collections.deque()

  async def acquire(self) -> None:
    if self.held < self.limit and not self._waiters:
      self.held += 1
      return
    waiter = asyncio.get_running_loop().create_future()
    self._waiters.append(waiter)
    try:
      await waiter
    except asyncio.CancelledError:
      if waiter.done() and not waiter.cancelled():
        self.release()  # given a slot as it was cancelled: pass it on
      raise

  def release(self) -> None:
    self.held -= 1
    self._wake()

  def set_limit(self, limit: float) -> None:
    self.limit = limit
    self._wake()

  def _wake(self) -> None:
    while self._waiters and self.held < self.limit:
      waiter = self._waiters.popleft()
      if not waiter.done():
        self.held += 1
        waiter.set_result(None)


class Prefix:
  """One prefix's window: unlimited until the store refuses a read, then
  AIMD. Loop thread only."""

  def __init__(self) -> None:
    self.gate = Gate(float("inf"))
    self.refusals = 0
    self._cut_at = 0.0

  @property
  def window(self) -> float:
    return self.gate.limit

  def refused(self) -> None:
    """The store answered 503 SlowDown or 429: halve the window (once per
    CUT_INTERVAL_S), from the depth that was refused."""
    self.refusals += 1
    now = time.monotonic()
    if now - self._cut_at < CUT_INTERVAL_S:
      return
    self._cut_at = now
    depth = self.gate.held if self.gate.limit == float("inf") else self.gate.limit
    self.gate.set_limit(max(MIN_WINDOW, depth / 2))

  def answered(self, unlimited_above: float) -> None:
    """A read succeeded: one more request per window's worth of successes;
    past `unlimited_above` (the process's own depth) the window is lifted."""
    limit = self.gate.limit
    if limit == float("inf"):
      return
    limit += 1.0 / limit
    self.gate.set_limit(float("inf") if limit > unlimited_above else limit)
