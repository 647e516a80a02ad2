"""A stream dataset's global batches, produced once for every host.

All H hosts of a job ask a worker for the same chunk of a stream (the same
dataset, G and starting position; clients send every chunk of a stream to
the same worker), each for its own rows. A `Session` holds the global
batches produced from one starting position, in order, and produces the
next only when a host asks for it; the others read what is there. When a
session has produced the chunk, its Grain iterator waits at the position
after it, and the session of the next chunk (which starts there) takes it
over instead of restoring from the state: one live iterator per stream and
no replay, however many hosts read. A worker holds sessions up to a byte
budget, least recently used out first; a request for a position no session
holds restores one (replaying at most one packing window: the stream's
Grain iterator's own restore).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable, Iterator

from grain_elevator.server.data.stream import GlobalBatch, StreamDataset

# Iterators of evicted sessions kept for the chunk that starts where they
# stand (their batches are dropped with the session).
_IDLE_ITERATORS = 8


class Session:
  """The global batches of one stream from one starting position."""

  def __init__(self, ds: StreamDataset, global_batch_size: int, start: str,
               it: Any | None):
    self._ds = ds
    self._g = global_batch_size
    self.start = start
    self._it = it  # opened on first use if None
    self._batches: list[GlobalBatch] = []
    self._ended = False
    self._lock = threading.Lock()
    self.nbytes = 0

  @property
  def position(self) -> str:
    """Where the live iterator stands: after the last batch produced."""
    return self._batches[-1][1] if self._batches else self.start

  def get(self, index: int) -> tuple[GlobalBatch | None, bool]:
    """Batch `index` of this session (None past the end), and whether this
    call produced it: it is produced when the first host asks for it (one
    producer at a time; the others wait for it)."""
    with self._lock:
      produced = len(self._batches) <= index and not self._ended
      while len(self._batches) <= index and not self._ended:
        if self._it is None:
          self._it = self._ds.open(self._g, self.position)
        batch = self._ds.next_batch(self._it, self._g)
        if batch is None:
          self._ended = True
        else:
          self._batches.append(batch)
          self.nbytes += sum(a.nbytes for a in batch[0])
      return (self._batches[index] if index < len(self._batches) else None), produced

  def take_iterator(self, position: str | None = None) -> Any | None:
    """The live iterator, if it stands at `position` (anywhere, if None)
    and nobody is producing: `(position, iterator)`."""
    if not self._lock.acquire(blocking=False):
      return None
    try:
      if self._it is None or self._ended or position not in (None, self.position):
        return None
      it, self._it = self._it, None
      return self.position, it
    finally:
      self._lock.release()


class StreamSessions:
  """One worker's sessions, by (dataset, fingerprint, G, starting position)."""

  def __init__(self, budget_bytes: int):
    self._budget = budget_bytes
    self._sessions: collections.OrderedDict[Hashable, Session] = collections.OrderedDict()
    self._in_use: collections.Counter[Hashable] = collections.Counter()
    # (dataset, fingerprint, G, position) -> a live iterator standing there.
    self._idle: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self._lock = threading.Lock()

  def batches(self, ds: StreamDataset, global_batch_size: int, start: str, count: int,
              is_active: Callable[[], bool] = lambda: True
              ) -> Iterator[tuple[GlobalBatch, bool]]:
    """Up to `count` global batches from position `start`, fewer if the
    stream ends, until `is_active()` is False; each with whether this
    request produced it (else another host's did)."""
    stream = (ds.info.name, ds.info.config_fingerprint, global_batch_size)
    key = (*stream, start)
    session = self._acquire(ds, global_batch_size, key, start)
    try:
      for i in range(count):
        if not is_active():
          return
        batch, produced = session.get(i)
        if batch is None:
          return
        yield batch, produced
    finally:
      self._release(key)

  def _acquire(self, ds: StreamDataset, global_batch_size: int, key: Hashable,
               start: str) -> Session:
    with self._lock:
      session = self._sessions.get(key)
      if session is None:
        it = self._idle.pop(key, None)
        for other_key, other in reversed(self._sessions.items()):
          if it is not None:
            break
          if other_key[:3] == key[:3]:
            taken = other.take_iterator(start)
            it = taken and taken[1]
        session = self._sessions[key] = Session(ds, global_batch_size, start, it)
      self._sessions.move_to_end(key)
      self._in_use[key] += 1
      return session

  def _release(self, key: Hashable) -> None:
    with self._lock:
      self._in_use[key] -= 1
      if not self._in_use[key]:
        del self._in_use[key]
      self._evict()

  def _evict(self) -> None:
    """Drops the least recently used sessions nobody reads, past the budget;
    their live iterators wait for the chunk that starts where they stand."""
    total = sum(s.nbytes for s in self._sessions.values())
    for key in list(self._sessions):
      if total <= self._budget:
        return
      if key in self._in_use:
        continue
      session = self._sessions.pop(key)
      total -= session.nbytes
      taken = session.take_iterator()
      if taken is not None:
        self._idle[(*key[:3], taken[0])] = taken[1]
        while len(self._idle) > _IDLE_ITERATORS:
          self._idle.popitem(last=False)

  @property
  def nbytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self._sessions.values())
