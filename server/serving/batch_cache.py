"""Steps shared between trainers: each encoded once, served to every reader.

Trainers that read the same stream (a hyperparameter sweep, an eval job
beside its training job) ask for the same steps: same dataset and config
fingerprint, same G, host slice, record offset and compression. A worker
keeps the encoded steps it served last, up to a byte budget, least recently
used out first, and answers a repeat from memory. A request for a step that
another request is producing right now waits for that one (at most
`wait_s`) instead of producing it twice.

Only references are kept, never copies: a lone trainer pays nothing but the
memory. That is sound because an encoded step references arrays the
pipeline returned, which nothing writes to afterwards (Grain's own
prefetching holds elements the same way). A shard changed on disk after a
step was cached does not change the cached bytes: they are what the shard
held when the server recorded it (server/data/shards/identity.py), the bytes every
replica serves; steps not cached are refused as before.

The byte budget counts the memory an entry keeps alive, not the bytes it
sends: a row that is a view of a bigger record (a RowStack of row views,
proto/rows.py) keeps the whole record, and a budget counted in views held
many times its size. So each entry is charged for the whole buffers its
parts reference, each once (`held_bytes`).

Workers are separate processes with a cache each, so the client sends every
request for a chunk of steps to the worker that owns the chunk
(client/transport/pool.py, `owner_of`): the same chunk from any trainer lands
on the same worker. Readers at different positions share nothing, and lose
nothing either.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable, Hashable, Sequence

import numpy as np

# How long a request waits for a step another request is producing; past
# it, it produces the step itself (a step takes ~0.1 ms to ~1 s).
DEFAULT_WAIT_S = 30.0


# Views of views are followed at most this far to the memory's owner (numpy
# points a view at its owner directly; memoryviews and frombuffer add a link).
_MAX_VIEW_DEPTH = 16


def _owner(buffer: Any) -> Any:
  """The object whose memory `buffer` shows: through a memoryview's exporter
  and a numpy view's base, to the object that allocated it."""
  for _ in range(_MAX_VIEW_DEPTH):
    if isinstance(buffer, memoryview) and buffer.obj is not None:
      buffer = buffer.obj
    elif isinstance(buffer, np.ndarray) and buffer.base is not None:
      buffer = buffer.base
    else:
      break
  return buffer


def _size(owner: Any) -> int:
  if isinstance(owner, np.ndarray):
    return owner.nbytes
  try:
    return memoryview(owner).nbytes
  except TypeError:  # an owner that is no buffer (a numpy base object)
    return sys.getsizeof(owner)


def held_bytes(parts: Sequence[Any]) -> int:
  """Memory an encoded step keeps alive: the buffers its parts are views
  of, each counted once, at their whole size."""
  owners = {id(o): o for o in map(_owner, parts)}
  return sum(_size(o) for o in owners.values())


class BatchCache:
  """Encoded steps by key, keeping at most `max_bytes` of memory alive
  (`held_bytes`); 0 keeps none."""

  def __init__(self, max_bytes: int, *, wait_s: float = DEFAULT_WAIT_S):
    self.max_bytes = max(0, max_bytes)
    self._wait_s = wait_s
    self._lock = threading.Lock()
    self._entries: collections.OrderedDict[Hashable, tuple[list[Any], int]] = (
        collections.OrderedDict())
    self._producing: dict[Hashable, threading.Event] = {}
    self.bytes = 0

  def holds(self, key: Hashable) -> bool:
    """Whether a step is here or being made (its reads need no plan)."""
    if not self.max_bytes:
      return False
    with self._lock:
      return key in self._entries or key in self._producing

  def get(self, key: Hashable, produce: Callable[[], list[Any]]) -> tuple[list[Any], bool]:
    """(the step's encoded parts, whether they came from the cache);
    `produce()` runs only if no request has them or is making them."""
    if not self.max_bytes:
      return produce(), False
    waited = False
    while True:
      with self._lock:
        entry = self._entries.get(key)
        if entry is not None:
          self._entries.move_to_end(key)
          return entry[0], True
        busy = self._producing.get(key)
        if busy is None or waited:
          mine = busy is None
          if mine:
            self._producing[key] = threading.Event()
          break
      busy.wait(self._wait_s)  # then look again: there, or produce it here
      waited = True
    try:
      parts = produce()
    except BaseException:
      if mine:
        self._done(key)
      raise
    self._put(key, parts)
    if mine:
      self._done(key)
    return parts, False

  def _done(self, key: Hashable) -> None:
    with self._lock:
      event = self._producing.pop(key, None)
    if event is not None:
      event.set()

  def _put(self, key: Hashable, parts: list[Any]) -> None:
    size = held_bytes(parts)
    if size > self.max_bytes:
      return  # bigger than the whole budget: would only evict the rest
    with self._lock:
      if key in self._entries:
        return
      while self.bytes + size > self.max_bytes:
        _, (_, evicted) = self._entries.popitem(last=False)
        self.bytes -= evicted
      self._entries[key] = (parts, size)
      self.bytes += size

  def __len__(self) -> int:
    return len(self._entries)
