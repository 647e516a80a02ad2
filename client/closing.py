"""Closing what a trainer dropped without closing, off the collector's path.

An iterator's `close()` cancels its requests, joins its threads and closes
its connections. Run from `__del__`, that can deadlock the whole process:
the garbage collector runs finalizers in whichever thread happens to
allocate, possibly inside `threading`'s own bookkeeping while it holds the
lock that joining a thread needs (seen in a test run: every later
`Thread.start()` waited forever). So `__del__` only queues the close
(`queue.SimpleQueue.put` is safe in finalizers) and one daemon thread,
started by a constructor, never by a finalizer, runs it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

log = logging.getLogger("grain_elevator.client")

_queue: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def start() -> None:
  """Makes sure the closing thread runs; call from constructors only."""
  global _thread
  if _thread is not None and _thread.is_alive():
    return
  with _start_lock:
    if _thread is None or not _thread.is_alive():
      _thread = threading.Thread(target=_run, name="grain-elevator-closer", daemon=True)
      _thread.start()


def later(close: Callable[[], None]) -> None:
  """Queues `close` for the closing thread: all a `__del__` may do. At
  interpreter exit (globals gone) there is nothing left to close for."""
  q = globals().get("_queue")
  if q is not None:
    q.put(close)


def _run() -> None:
  while True:
    close = _queue.get()
    try:
      close()
    except Exception:  # pylint: disable=broad-except
      log.debug("closing a dropped iterator failed", exc_info=True)
    del close  # not kept alive until the next one arrives


def _forget_thread() -> None:
  global _thread
  _thread = None  # a forked child has no closing thread; the next start() makes one


os.register_at_fork(after_in_child=_forget_thread)
