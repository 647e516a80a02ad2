"""What a bucket's reads take, measured: the quantiles that set how many
requests to keep in flight (Little's law) and when to ask a straggler again.

Little's law: requests in flight = the rate they are asked for x the time
each takes. A bucket's time to first byte has a long tail (tens of ms at the
median, several times that at the p99), so a reader planned for the median
stalls on the tail: depth is sized for the p99, and a read still missing
past the p95 is asked for again (objects.py). Only small reads are sampled
(at most SAMPLED_BYTES): a big range's time is its transfer, not the
store's latency.
"""

from __future__ import annotations

import threading
import time

import numpy as np

# Reads larger than this are not sampled (their time is mostly transfer).
SAMPLED_BYTES = 4 << 20
# The last this many reads make the quantiles.
WINDOW = 1024
# Quantiles are recomputed at most this often (they cost a partition of WINDOW).
REFRESH_S = 0.2
# Until this many reads are sampled, the quantiles are these guesses (an
# in-region bucket's): the first requests are not hedged too eagerly.
MIN_SAMPLES = 32
GUESS_S = {50: 0.025, 95: 0.1, 99: 0.15}
# The asked-for rate is counted over windows this long.
RATE_WINDOW_S = 1.0


class Latency:
  """Recent read times and the rate reads are asked for, in one process.
  Thread-safe (`_lock`); `record` and `asked` cost a few hundred ns."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._samples = np.zeros(WINDOW, np.float64)
    self._count = 0
    self._quantiles = dict(GUESS_S)
    self._computed_at = 0.0
    self._rate = 0.0
    self._window_start = time.monotonic()
    self._window_asked = 0

  def record(self, seconds: float, nbytes: int) -> None:
    """One read took `seconds` (first byte to last) for `nbytes`."""
    if nbytes > SAMPLED_BYTES:
      return
    with self._lock:
      self._samples[self._count % WINDOW] = seconds
      self._count += 1

  def asked(self, count: int = 1) -> None:
    """`count` reads were asked for now."""
    now = time.monotonic()
    with self._lock:
      self._window_asked += count
      elapsed = now - self._window_start
      if elapsed >= RATE_WINDOW_S:
        rate = self._window_asked / elapsed
        # A smoothed rate that follows a rise at once and a fall over a few windows.
        self._rate = rate if rate > self._rate else 0.5 * self._rate + 0.5 * rate
        self._window_start, self._window_asked = now, 0

  @property
  def rate(self) -> float:
    """Reads asked for per second (the last full window, smoothed)."""
    return self._rate

  def quantile(self, q: int) -> float:
    """The q-th percentile (50, 95 or 99) of recent reads' seconds."""
    now = time.monotonic()
    with self._lock:
      if self._count >= MIN_SAMPLES and now - self._computed_at >= REFRESH_S:
        window = self._samples[:min(self._count, WINDOW)]
        values = np.percentile(window, [50, 95, 99])
        self._quantiles = {50: float(values[0]), 95: float(values[1]), 99: float(values[2])}
        self._computed_at = now
      return self._quantiles[q]

  def depth(self, floor: int, ceiling: int) -> int:
    """Requests to allow in flight: Little's law at the p99 with room for
    bursts (twice the asked-for rate), within [floor, ceiling]."""
    wanted = 2.0 * self._rate * self.quantile(99)
    return int(min(ceiling, max(floor, wanted)))

  def horizon_s(self) -> float:
    """How far ahead a plan should reach: a read asked for now is back by
    then at the p99, with its hedge, with a p99's room for the steps
    queued behind it (at p99 + p95 alone a trainer paced at 2,000 records/s
    of 100 KB from a bucket at p50 120 ms / p99 600 ms got 0.93-0.95x its
    pace; at this, 0.97x)."""
    return 2 * self.quantile(99) + self.quantile(95)
