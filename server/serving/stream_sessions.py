"""A stream dataset's global batches, produced once for every host, in bounded memory.

All H hosts of a job ask a worker for the same chunk of a stream (the same
dataset, G and starting position; clients send every chunk of a stream to
one worker), each for its own rows. A `Session` holds the global batches
made from one starting position, in order, and makes the next only when a
host asks for it; the others read what is there. Its live Grain iterator
then waits at the position after its last batch, and the session of the
next chunk (which starts there) takes it over instead of restoring from the
position: one live iterator per stream and no replay, however many hosts
read.

What a worker holds is bounded by construction:

  * a batch is dropped as soon as every host of every job reading the
    session has passed it (a host is its request's (shard_count,
    shard_index); at most MAX_TRACKED_HOSTS are followed per session);
  * batches and live iterators (each estimated by
    StreamDataset.iterator_bytes) count against a byte budget, and sessions
    against MAX_STREAM_SESSIONS; past either, least recently used first:
    sessions nobody reads, then sessions being read; of the session each
    stream used last (each sub-stream of a stream of several is a stream
    here: server/data/streams/sub_streams.py), its batches go but never its
    live iterator, which that stream's next chunk needs, so N sub-streams
    served by one worker do not restore each other's positions over and
    over;
  * a session is registered only once its iterator stands at its start, so
    a refused position leaves nothing behind, and one whose production
    fails is dropped.

A host whose batch is gone (dropped, or its session evicted) continues on
its own from the position before that batch, which it holds: another
session there, restored by Grain's own set_state (replaying at most one
packing window). Eviction costs time, never exactness.

Lookups are O(1): sessions by (stream, start), and live iterators by
(stream, the position where they stand).

Thread-safety: `StreamSessions`' fields are guarded by its `_lock`; a
`Session`'s by its `_lock`, held briefly, and its production by
`_producing`, held while one batch is made (one producer at a time; readers
of batches already made do not wait for it). The registry's lock may be
held while a session's `_lock` is taken, never the other way round.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from typing import Any, Callable, Iterator

from grain_elevator.proto.errors import Cancelled
from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.data.streams import cancellation
from grain_elevator.server.data.streams.stream import GlobalBatch, StreamDataset
from grain_elevator.server.serving import metrics

log = logging.getLogger("grain_elevator.server")

# Sessions one worker keeps, however small they are.
MAX_STREAM_SESSIONS = 256
# Hosts whose progress one session follows (to drop what all have passed),
# each charged _HOST_BYTES; hosts beyond it are served, and what they read
# is left to the budget.
MAX_TRACKED_HOSTS = 1024
_HOST_BYTES = 128
# How often a request waits for another positioning the session it wants
# before it looks again (and whether it is still wanted).
_OPENING_POLL_S = 0.5
_LOG_PERIOD_S = 60.0

Stream = tuple[str, str, int]  # dataset, config fingerprint, G
Host = tuple[int, int]         # (shard_count H, shard_index h)
Key = tuple[Stream, str]       # a stream and a position in it


class _Dropped:
  """`Session.get`: that batch is gone here; go on from your own position."""


DROPPED = _Dropped()
_MISSING = object()


class Session:
  """The global batches of one stream from one starting position."""

  def __init__(self, ds: StreamDataset, key: Key, it: Any):
    self.ds = ds
    self.key = key
    self._g = key[0][2]
    self._lock = threading.Lock()
    self._producing = threading.Lock()
    # Guarded by _lock:
    self._batches: dict[int, GlobalBatch] = {}  # by index; those still held
    self._made = 0  # batches made: indices [0, _made)
    self._position = key[1]  # where _it stands: after batch _made - 1
    self._it = it
    self._ended = False
    self._evicted = False
    self._progress: dict[Host, int] = {}  # batches each host has passed
    self._jobs: set[int] = set()  # the H of the hosts followed
    self._passes: dict[int, collections.Counter[int]] = {}  # index -> H -> hosts passed
    self.batch_bytes = 0
    self.iterator_bytes = ds.iterator_bytes(self._g)
    # Guarded by the registry's lock:
    self.readers = 0
    self.listed_at: Key | None = None  # its entry in StreamSessions._at

  @property
  def nbytes(self) -> int:
    return self.batch_bytes + self.iterator_bytes + _HOST_BYTES * len(self._progress)

  @property
  def position(self) -> str | None:
    """Where its live iterator stands (None without one)."""
    with self._lock:
      return self._position if self._it is not None and not self._ended else None

  @property
  def empty(self) -> bool:
    """Holds nothing anyone could use."""
    with self._lock:
      return not self._batches and (self._it is None or self._ended)

  def get(self, index: int, host: Host, is_active: Callable[[], bool]
          ) -> tuple[GlobalBatch, bool] | _Dropped | None:
    """Batch `index` and whether this call made it (None past the stream's
    end; DROPPED if it is gone here). A batch is made when the first host
    asks for it, under `is_active` (server/data/streams/cancellation.py)."""
    with self._lock:
      got = self._held(index, host)
    if got is not _MISSING:
      return got
    with self._producing:
      with self._lock:
        got = self._held(index, host)
        if got is not _MISSING:
          return got
        it, position = self._it, self._position
      try:
        with cancellation.producing_for(is_active):
          if it is None:  # thrown away by a production cut short: restore
            it = self.ds.open(self._g, position)
          batch = self.ds.next_batch(it, self._g)
      except BaseException:
        with self._lock:  # it stands inside a batch, or nowhere: never used again
          self._it, self.iterator_bytes = None, 0
        raise
      with self._lock:
        if batch is None:
          self._ended, self._it, self.iterator_bytes = True, None, 0
          return None
        if self._evicted:  # the batch is this request's alone
          self._it = None
          return batch, True
        self._it, self.iterator_bytes = it, self.ds.iterator_bytes(self._g)
        self._batches[index] = batch
        self._made, self._position = index + 1, batch[1]
        self.batch_bytes += _nbytes(batch)
        self._pass(index, host)
        return batch, True

  def _held(self, index: int, host: Host) -> Any:
    """What `get` answers without making a batch, or _MISSING (hold _lock)."""
    batch = self._batches.get(index)
    if batch is not None:
      self._pass(index, host)
      return batch, False
    if index < self._made or self._evicted:
      return DROPPED
    if self._ended:
      return None
    return _MISSING

  def _pass(self, index: int, host: Host) -> None:
    """`host` has read batch `index`: drops it once every followed host of
    every job reading here has (hold _lock)."""
    passed = self._progress.get(host)
    if passed is None:
      if len(self._progress) >= MAX_TRACKED_HOSTS:
        return
      passed = 0
      self._jobs.add(host[0])
    if index != passed:  # read again (a retry): counted once
      return
    self._progress[host] = index + 1
    passes = self._passes.setdefault(index, collections.Counter())
    passes[host[0]] += 1
    if all(passes[h] >= h for h in self._jobs):
      self._drop(index)

  def _drop(self, index: int) -> None:
    batch = self._batches.pop(index, None)
    self._passes.pop(index, None)
    if batch is not None:
      self.batch_bytes -= _nbytes(batch)

  def drop_batches(self) -> int:
    """Drops every batch (their hosts go on from their own positions);
    returns how many."""
    with self._lock:
      dropped = len(self._batches)
      for index in list(self._batches):
        self._drop(index)
      return dropped

  def take_iterator(self, position: str) -> Any | None:
    """The live iterator, if it stands at `position` and nobody is making
    a batch with it; this session keeps none."""
    if not self._producing.acquire(blocking=False):
      return None
    try:
      with self._lock:
        if self._it is None or self._ended or self._evicted or self._position != position:
          return None
        it, self._it, self.iterator_bytes = self._it, None, 0
        return it
    finally:
      self._producing.release()

  def evict(self) -> None:
    """Drops everything; its readers go on from their own positions. A
    batch being made goes to its request alone, and the iterator with it."""
    self.drop_batches()
    with self._lock:
      self._evicted = True
      if self._producing.acquire(blocking=False):
        self._it, self.iterator_bytes = None, 0
        self._producing.release()


def _nbytes(batch: GlobalBatch) -> int:
  return sum(a.nbytes for a in batch[0])


class StreamSessions:
  """One worker's sessions of every stream, within `budget_bytes` and
  `max_sessions` (module docstring)."""

  def __init__(self, budget_bytes: int, *, max_sessions: int = MAX_STREAM_SESSIONS):
    self.budget_bytes = max(0, budget_bytes)
    self.max_sessions = max(1, max_sessions)
    self._lock = threading.Lock()
    # Guarded by _lock:
    self._sessions: collections.OrderedDict[Key, Session] = collections.OrderedDict()  # LRU first
    self._at: dict[Key, Session] = {}  # sessions by where their live iterator stands
    self._opening: dict[Key, threading.Event] = {}  # being positioned by a request
    self.evictions = 0
    self._warnings = Throttled(_LOG_PERIOD_S, log)

  def batches(self, ds: StreamDataset, global_batch_size: int, start: str, count: int,
              host: Host, is_active: Callable[[], bool] = lambda: True
              ) -> Iterator[tuple[GlobalBatch, bool]]:
    """Up to `count` global batches from position `start`, fewer if the
    stream ends, until `is_active()` is False; each with whether this
    request made it (else another host's did). InvalidRequestError if
    `start` is no position of the stream (nothing is kept of it)."""
    stream = (ds.info.name, ds.info.config_fingerprint, global_batch_size)
    position, done, stale = start, 0, None
    while done < count:
      session = self._acquire(ds, (stream, position), is_active, replace=stale)
      try:
        for index in itertools.count():
          if done >= count or not is_active():
            return
          got = session.get(index, host, is_active)
          if got is None:
            return
          if got is DROPPED:  # on from `position`, in another session
            stale = session if index == 0 else None  # it cannot start us either
            break
          batch, made = got
          if made:
            self._made(session, batch)
          yield batch, made
          position, done = batch[1], done + 1
      except Cancelled:
        raise  # the batches made stand; the iterator was thrown away
      except Exception:
        self._remove(session)
        raise
      finally:
        self._release(session)

  @property
  def nbytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self._sessions.values())

  def __len__(self) -> int:
    with self._lock:
      return len(self._sessions)

  # -- the registry -----------------------------------------------------------

  def _acquire(self, ds: StreamDataset, key: Key, is_active: Callable[[], bool], *,
               replace: Session | None = None) -> Session:
    """The session at `key`, positioned and registered, with this request
    counted as its reader. `replace`: a session at `key` that no longer
    holds its first batch (this host read it before, and a retry reads it
    again): it is evicted and a new one made."""
    while True:
      with self._lock:
        session = self._sessions.get(key)
        if session is not None and session is replace:
          self._unregister(session)
          session.evict()
          self.evictions += 1
          metrics.current().stream_session_evicted()
          session = None
        if session is not None:
          self._sessions.move_to_end(key)
          session.readers += 1
          return session
        opening = self._opening.get(key)
        if opening is None:
          self._opening[key] = threading.Event()
          break
      while not opening.wait(_OPENING_POLL_S):  # another request is positioning it
        if not is_active():
          raise Cancelled(f"dataset {key[0][0]!r}: the request ended while waiting")
    try:
      with self._lock:
        it = self._take_iterator(key)
      if it is None:
        with cancellation.producing_for(is_active):
          it = ds.open(key[0][2], key[1])  # refused: nothing registered
      session = Session(ds, key, it)
      with self._lock:
        session.readers = 1
        self._sessions[key] = session
        self._list(session)
        self._fit()
      return session
    finally:
      with self._lock:
        self._opening.pop(key).set()

  def _take_iterator(self, key: Key) -> Any | None:
    """A live iterator standing at `key`'s position, taken from its session
    (hold _lock)."""
    owner = self._at.pop(key, None)
    if owner is None:
      return None
    owner.listed_at = None
    it = owner.take_iterator(key[1])
    if it is not None and not owner.readers and owner.empty:
      self._unregister(owner)
    return it

  def _list(self, session: Session) -> None:
    """Files `session` by where its live iterator stands now (hold _lock)."""
    if session.listed_at is not None and self._at.get(session.listed_at) is session:
      del self._at[session.listed_at]
    position = session.position
    session.listed_at = None if position is None else (session.key[0], position)
    if session.listed_at is not None:
      self._at[session.listed_at] = session

  def _made(self, session: Session, batch: GlobalBatch) -> None:
    size = _nbytes(batch)
    if 0 < self.budget_bytes < size:
      name = session.key[0][0]
      self._warnings.warning(
          ("over budget", name), "dataset %r: a global batch of %d bytes (G=%d) is over "
          "this worker's %d bytes for stream sessions: its hosts each produce it; give "
          "the server more (--batch-cache-mb)", name, size, session.key[0][2],
          self.budget_bytes)
    with self._lock:
      if self._sessions.get(session.key) is session:
        self._sessions.move_to_end(session.key)
        self._list(session)
        self._fit()

  def _release(self, session: Session) -> None:
    with self._lock:
      session.readers -= 1
      if (not session.readers and self._sessions.get(session.key) is session
          and session.empty):
        self._unregister(session)
      self._fit()

  def _remove(self, session: Session) -> None:
    """Drops a session whose production failed."""
    with self._lock:
      if self._sessions.get(session.key) is session:
        self._unregister(session)
      session.evict()
      self._publish()

  def _unregister(self, session: Session) -> None:
    del self._sessions[session.key]
    if session.listed_at is not None and self._at.get(session.listed_at) is session:
      del self._at[session.listed_at]
    session.listed_at = None

  def _fit(self) -> None:
    """Evicts, least recently used first, until within the budget and the
    count (hold _lock): sessions nobody reads, then sessions being read,
    then the batches of each stream's session used last; never their live
    iterators."""
    sessions = self._sessions
    total = sum(s.nbytes for s in sessions.values())
    if total > self.budget_bytes or len(sessions) > self.max_sessions:
      last: dict[Stream, Session] = {}  # each stream's session used last
      for session in sessions.values():
        last[session.key[0]] = session
      kept = set(map(id, last.values()))
      for reading in (False, True):
        for session in [s for s in sessions.values() if bool(s.readers) == reading]:
          if total <= self.budget_bytes and len(sessions) <= self.max_sessions:
            break
          if id(session) in kept:
            continue
          total -= session.nbytes
          self._unregister(session)
          session.evict()
          self.evictions += 1
          metrics.current().stream_session_evicted()
      for session in [s for s in sessions.values() if id(s) in kept]:  # LRU first
        if total <= self.budget_bytes:
          break
        dropped = session.batch_bytes
        if session.drop_batches():
          total -= dropped
          self.evictions += 1
          metrics.current().stream_session_evicted()
    self._publish()

  def _publish(self) -> None:
    """The metrics of what is held (hold _lock)."""
    metrics.current().stream_sessions(len(self._sessions),
                                      sum(s.nbytes for s in self._sessions.values()))
