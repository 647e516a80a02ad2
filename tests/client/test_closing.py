"""A dropped iterator is closed by the closing thread (client/closing.py),
never in the garbage collector's thread: its finalizer returns at once even
where that thread holds a lock that joining a thread needs (the deadlock a
test run froze in), and the iterator's threads still end."""

from __future__ import annotations

import threading
import time

import pytest

from grain_elevator.client import RemoteDataset


def _fetch_threads() -> set[threading.Thread]:
  return {t for t in threading.enumerate() if t.name.startswith("grain-elevator-fetch")}


@pytest.mark.timeout(60)
def test_a_finalizer_never_joins_in_the_collectors_thread(server):
  before = _fetch_threads()
  ds = RemoteDataset(server.target, "forever", 64, prefetch=4)
  it = iter(ds)
  next(it)
  mine = _fetch_threads() - before
  assert mine, "the iterator fetches on threads of its own"
  # The collector can run a finalizer in a thread that is inside threading's
  # bookkeeping (Thread._bootstrap_inner -> _maintain_shutdown_locks) and
  # holds this lock, which joining a non-daemon thread takes too.
  with threading._shutdown_locks_lock:  # pylint: disable=protected-access
    it.__del__()  # pylint: disable=unnecessary-dunder-call
  deadline = time.monotonic() + 30
  while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(t.is_alive() for t in mine), "the dropped iterator was never closed"
  with pytest.raises(Exception, match="closed"):
    next(it)
