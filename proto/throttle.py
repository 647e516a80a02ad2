"""Rate-limited warnings, for situations that come by the hundred.

A full replica refuses requests by the hundred (the client), a flood of
garbage or of connections past the descriptor limit repeats one problem as
fast as the peer can send it (the server): logging each would cost more than
the problem and bury everything else. One line per period and situation
says it is happening, and how often.

  throttled = Throttled(10.0, log)
  throttled.warning(("full", replica), "%s is full; %s", replica, what_now)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any


class Throttled:
  """Warnings logged at most once per `period_s` for each key (a situation:
  which replica, what was done); the next line counts those it stands for.

  Keys are kept for as long as this object, so they should come from a small
  set (never from a peer's bytes or address alone). Thread-safe.
  """

  def __init__(self, period_s: float, log: logging.Logger | None = None):
    self._period_s = period_s
    self._log = log if log is not None else logging.getLogger("grain_elevator")
    self._lock = threading.Lock()
    self._logged_at: dict[Any, float] = {}
    self._unlogged: collections.Counter[Any] = collections.Counter()

  def warning(self, key: Any, message: str, *args: Any, exc_info: bool = False) -> None:
    """Logs `message % args` unless a line for `key` was logged within the
    period; a suppressed line is counted in the next one for `key`.
    `exc_info`: the exception being handled goes with the line logged."""
    with self._lock:
      now = time.monotonic()
      if now - self._logged_at.get(key, -self._period_s) < self._period_s:
        self._unlogged[key] += 1
        return
      more = self._unlogged.pop(key, 0)
      self._logged_at[key] = now
    self._log.warning(message + "%s", *args,
                      f" ({more} more since the last such line)" if more else "",
                      exc_info=exc_info)
