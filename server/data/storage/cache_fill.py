"""Filling a worker's share of the cache (cache.py): a block a read touched
first, then every block of every bucket object the server serves.

Each worker runs one filler thread. Blocks are claimed (cache.py's
`claim`), so the server's workers fill each block once between them; each
starts at its own place in the list (worker i of W at object i/W of it), so
they rarely meet. A fill is one ranged GET of BLOCK_BYTES, pinned to the
object's recorded identity like every read (a replaced object fails it, and
nothing is written). At most FILL_IN_FLIGHT fills per worker are on their
way: the steps' own reads, planned or not, keep the rest of the depth.
The first worker logs the progress every PROGRESS_S and when the cache
holds everything it was asked to.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import Iterable, Iterator

from grain_elevator.server.data.storage import cache as cache_lib
from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage.objects import ObjectRef

_log = logging.getLogger("grain_elevator.server.cache")

# Block fills on their way at once, per worker (8 MiB each).
FILL_IN_FLIGHT = 4
# The first worker's progress line, at most this often.
PROGRESS_S = 10.0
# After a pass that left blocks to others' claims or to failed reads, the
# next pass starts this long after.
PASS_PAUSE_S = 5.0

# Every bucket object the datasets of this process read, as recorded (a
# forked worker starts its own list: what its parent opened is not its).
_known: list[ObjectRef] = []
_known_pid = os.getpid()
_known_lock = threading.Lock()


def _mine() -> list[ObjectRef]:
  """This process's list (under _known_lock)."""
  global _known, _known_pid
  if _known_pid != os.getpid():
    _known, _known_pid = [], os.getpid()
  return _known


def known(objs: Iterable[ObjectRef]) -> None:
  """The objects a source reads (object_source.py, when opened)."""
  with _known_lock:
    mine = _mine()
    seen = set(mine)
    new = [o for o in objs if o not in seen and cache_lib.cacheable(o)]
    mine.extend(new)
  if new and _filler is not None:
    _filler.learned()


class Filler:
  """One worker's filler thread."""

  def __init__(self, cache: cache_lib.ObjectCache, index: int = 0, count: int = 1):
    self._cache = cache
    self._index, self._count = index, max(1, count)
    self._touched: collections.OrderedDict[tuple[ObjectRef, int], None] = (
        collections.OrderedDict())
    self._wake = threading.Condition()
    self._slots = threading.BoundedSemaphore(FILL_IN_FLIGHT)
    self._stopped = False
    self._full = False
    self._new = False  # objects became known during a pass
    self._reported = -1
    self._thread = threading.Thread(target=self._run, daemon=True, name="elevator-cache-fill")
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "elevator-cache-write")

  def start(self) -> "Filler":
    self._thread.start()
    return self

  def stop(self) -> None:
    with self._wake:
      self._stopped = True
      self._wake.notify_all()

  def learned(self) -> None:
    """More objects are known: another pass."""
    with self._wake:
      self._new = True
      self._wake.notify()

  def touched(self, obj: ObjectRef, blocks: Iterable[int]) -> None:
    """A read needed these blocks and the cache did not hold them: they
    are filled before the rest."""
    with self._wake:
      for b in blocks:
        self._touched[(obj, b)] = None
      while len(self._touched) > 4096:
        self._touched.popitem(last=False)
      self._wake.notify()

  # -- the thread ------------------------------------------------------------------

  def _everything(self) -> Iterator[tuple[ObjectRef, int]]:
    with _known_lock:
      objs = sorted(_mine(), key=lambda o: o.url)
    start = len(objs) * self._index // self._count
    for obj in objs[start:] + objs[:start]:
      for block in range(-(-obj.size // cache_lib.BLOCK_BYTES)):
        yield obj, block

  def _next(self, background: Iterator[tuple[ObjectRef, int]]) -> tuple[ObjectRef, int] | None:
    """A touched block, or the next of the pass; None when the pass is done."""
    with self._wake:
      if self._touched:
        return self._touched.popitem(last=False)[0]
    if self._full:
      return None
    return next(background, None)

  def _run(self) -> None:
    last_log = 0.0
    while not self._stopped:
      background = self._everything()
      left = False  # blocks this pass left to others' fills, or to no room
      while not self._stopped:
        item = self._next(background)
        if item is None:
          break
        try:
          outcome = self._cache.claim(*item)
        except OSError as e:  # a disk that fails: this block is left to the bucket
          _log.warning("cache: cannot claim block %d of %s in %s (%s)", item[1], item[0].url,
                       self._cache.root, e)
          outcome = "busy"
        if outcome == "mine":
          self._slots.acquire()
          try:
            self._start(*item)
          except Exception as e:  # pylint: disable=broad-except
            self._slots.release()
            self._cache.fill(item[0], item[1], None)  # gives the claim back
            _log.warning("cache: cannot fill block %d of %s (%s)", item[1], item[0].url, e)
        elif outcome != "held":
          left = True
          self._full = self._full or outcome == "full"
        now = time.monotonic()
        if now - last_log >= PROGRESS_S:
          last_log = now
          self._report()
      self._report()
      with self._wake:
        if not self._touched and not self._stopped and not self._new:
          self._wake.wait(timeout=PASS_PAUSE_S if left else None)
        self._new = False

  def _start(self, obj: ObjectRef, block: int) -> None:
    begin = block * cache_lib.BLOCK_BYTES
    end = begin + self._cache.block_size(obj, block)
    (future,) = objects_lib.objects().fetch_later([(obj, begin, end)])

    def write(f: concurrent.futures.Future) -> None:
      try:
        data = f.result()
      except Exception as e:  # pylint: disable=broad-except
        _log.warning("cache: could not fill block %d of %s (%s); its records are read by plan",
                     block, obj.url, e)
        data = None
      try:
        self._cache.fill(obj, block, data)
      except OSError as e:
        _log.warning("cache: could not write block %d of %s to %s (%s)", block, obj.url,
                     self._cache.root, e)
      finally:
        self._slots.release()

    # Written by the filler's own writer thread: the future settles on the
    # storage loop, which must not wait on a disk (8 MiB and an fsync).
    future.add_done_callback(lambda f: self._writer.submit(write, f))

  def _report(self) -> None:
    with _known_lock:
      objs = list(_mine())
    wanted = sum(o.size for o in objs)
    used = self._cache.usage()
    self._cache.counts.object_cache_bytes(used, wanted)
    if self._index == 0 and wanted and used != self._reported:
      self._reported = used
      _log.info("cache: %.1f MiB of %.1f MiB of bucket objects held in %s (%.0f%%)%s",
                used / 2**20, wanted / 2**20, self._cache.root, 100 * min(1.0, used / wanted),
                "; full: the rest is read by plan" if self._full else "")


_filler: Filler | None = None


def start(cache: cache_lib.ObjectCache, index: int = 0, count: int = 1) -> Filler:
  """Starts this process's filler (a worker's, once its datasets are open)."""
  global _filler
  if _filler is not None:
    _filler.stop()
  _filler = Filler(cache, index, count).start()
  return _filler


def current() -> Filler | None:
  return _filler
