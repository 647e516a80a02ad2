"""Where a shard in a bucket is read: byte ranges of the object, never the
whole object for one record.

The reader is reader.py's, with the bytes coming from ranged reads instead
of pread: at open, the object's tail (postscript and, usually, the whole
footer: the chunk index) in one read, parsed into the index the reader
keeps (about 40 bytes a chunk, as for a file; the tail's bytes are let
go); for a batch, `plan` names the extents of the chunks its records need,
neighbours coalesced (storage/ranges.py: chunks that touch or lie within
COALESCE_GAP_BYTES are one read), the caller fetches them, with every other
shard's, concurrently (storage/objects.py), and `read` decodes the records
from them. The same riegeli hash checks run on those bytes (riegeli.c's
parse_chunk); a corrupt chunk is CorruptShard naming the URL and its byte
offset.

`read(positions, fetched)` takes any mapping of (begin -> bytes) that
covers the plan, so a planner that fetches the next steps' ranges ahead can
hand in what it holds; a range missing from it is fetched on the spot.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Iterator, Mapping, Sequence

from grain_elevator.proto.errors import ShardChangedError
from grain_elevator.server.data.shards import chunks
from grain_elevator.server.data.shards.chunks import UnsupportedShard
from grain_elevator.server.data.shards.reader import ShardReader
from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage.ranges import coalesce


class Fetched:
  """Byte ranges of one object, by start: what a batch's reads got."""

  def __init__(self, ranges: Mapping[int, bytes] | None = None):
    self._starts: list[int] = sorted(ranges or ())
    self._data = dict(ranges or {})

  def add(self, begin: int, data: bytes) -> None:
    if begin not in self._data:
      bisect.insort(self._starts, begin)
    self._data[begin] = data

  def get(self, begin: int, end: int) -> memoryview | None:
    """[begin, end) if one range holds it, else None."""
    i = bisect.bisect_right(self._starts, begin) - 1
    if i < 0:
      return None
    start = self._starts[i]
    data = self._data[start]
    if end - start > len(data):
      return None
    return memoryview(data)[begin - start:end - start]


class ObjectShardReader(ShardReader):
  """Random access to one ArrayRecord shard in a bucket; safe to share
  between threads (each thread's batch ranges are its own)."""

  def __init__(self, obj: objects_lib.ObjectRef, tail: Fetched):
    """`tail`: the object's last bytes, read pinned to `obj` (identity.py
    recorded their hash), from which the footer is read; not kept."""
    if chunks.riegeli is None:
      raise UnsupportedShard("grain_elevator.server.data.shards._riegeli was not built")
    self.path = obj.url
    self._fd = -1
    self._obj = obj
    self._local = threading.local()
    with self._using(tail):  # the footer's reads come from it
      self._open(obj.size)

  @property
  def obj(self) -> objects_lib.ObjectRef:
    """The object, as recorded: what every read of it is pinned to."""
    return self._obj

  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_local"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._local = threading.local()

  @contextlib.contextmanager
  def _using(self, fetched: Fetched | None) -> Iterator[None]:
    before = getattr(self._local, "fetched", None)
    self._local.fetched = fetched
    try:
      yield
    finally:
      self._local.fetched = before

  def _bytes(self, begin: int, end: int) -> memoryview | bytes:
    fetched = getattr(self._local, "fetched", None)
    got = fetched.get(begin, end) if fetched is not None else None
    if got is not None:
      return got
    (data,) = objects_lib.objects().fetch([(self._obj, begin, end)])
    return data

  def _read_chunk(self, begin: int, end: int) -> tuple[int, int, int, bytes]:
    data = self._bytes(begin, end)
    try:
      return chunks.riegeli.parse_chunk(data, begin)
    except ValueError as e:
      raise self._corrupt(begin, e) from e

  def _read_record(self, begin: int, end: int) -> bytes | None:
    return None  # the chunk's bytes are in memory already: read_chunk's path

  def extents(self, indices: Sequence[int]) -> list[tuple[int, int]]:
    """The extents [begin, end) of the chunks the records at `indices`
    need, each once, sorted: the bytes a read of them needs."""
    self._check_indices(indices)
    return [self.extent(c) for c in sorted(set(self.chunks_of(indices).tolist()))]

  def plan(self, indices: Sequence[int]) -> list[tuple[int, int]]:
    """The byte ranges the records at `indices` need: their chunks'
    extents, sorted, neighbours coalesced."""
    return coalesce(self.extents(indices))

  def read(self, indices: Sequence[int], fetched: Fetched | None = None) -> list[bytes]:
    """The records at `indices`, from `fetched` (the ranges `plan` named;
    any missing is fetched now)."""
    with self._using(fetched):
      return super().read(indices)

  def close(self) -> None:
    pass


def open_object_shard(obj: objects_lib.ObjectRef, tail_hash: str, tail_bytes: int
                      ) -> ObjectShardReader:
  """Reads the object's last `tail_bytes` (pinned) and opens it; the tail
  must hash to what was recorded (ShardChangedError otherwise)."""
  from grain_elevator.server.data.shards import identity  # pylint: disable=g-import-not-at-top
  n = min(obj.size, tail_bytes)
  (tail,) = objects_lib.objects().fetch([(obj, obj.size - n, obj.size)])
  if identity.tail_hash(tail) != tail_hash:
    raise ShardChangedError(f"shard {obj.url} changed since the server started (its last "
                            f"{n} bytes differ): restart the server to serve the new data; "
                            "the stream fingerprint will change")
  return ObjectShardReader(obj, Fetched({obj.size - n: tail}))
