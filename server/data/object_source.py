"""The record source Grain sees for shards in a bucket (gs://, s3://, az://).

The sibling of record_source.py's BatchedArrayRecordSource, with the same
surface (`len`, `__getitem__`, `_getitems`, `read_raw`, `where`): Grain's
shuffle, repeat and mix run over it unchanged, so a bucket and a local copy
of the same shards give the same stream. A batch's records are planned
shard by shard (shards/object_reader.py): the chunks the read-ahead holds
for it come from there (storage/read_ahead.py, planned before the batch was
asked for), and all the other byte ranges go out at once
(storage/objects.py), pinned to each object's recorded identity.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Mapping, Sequence

import numpy as np

from grain_elevator.proto.errors import ConfigError, DataLossError, ShardChangedError
from grain_elevator.server.data.shards import identity as identity_lib
from grain_elevator.server.data.shards.chunks import CorruptShard, UnsupportedShard
from grain_elevator.server.data.shards.object_reader import (Fetched, ObjectShardReader,
                                                             open_object_shard)
from grain_elevator.server.data.storage import cache as cache_lib
from grain_elevator.server.data.storage import cache_fill
from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage import read_ahead
from grain_elevator.server.data.storage.ranges import coalesce
from grain_elevator.server.data.storage.settings import StorageSettings

# Shards opened at once (each one or two ranged reads of its tail).
_OPEN_THREADS = 32


def _not_recorded(url: str) -> ShardChangedError:
  return ShardChangedError(
      f"shard {url} was not among the dataset's files when the server started: restart the "
      "server to serve it; the stream fingerprint will change")


class ObjectRecordSource:
  """Random access to a dataset's ArrayRecord shards in a bucket.

  `identities`: each object's identity as the server recorded it at start
  (None: recorded now, for embedded mode and tools); every read is pinned
  to it. Opening reads each shard's tail (its footer); ConfigError names a
  shard this reader cannot decode (ArrayRecord's own reader reads files
  only: brotli, snappy or transposed shards must be copied locally).
  """

  def __init__(self, urls: Sequence[str], storage: StorageSettings | None = None, *,
               identities: Mapping[str, Any] | None = None, dataset: str = ""):
    self._urls = list(urls)
    self._storage = storage or StorageSettings()
    self.dataset = dataset
    if identities is None:
      identities = identity_lib.shard_identities(self._urls, dataset=dataset,
                                                 storage=self._storage)
    self.identities = {u: identities.get(u) for u in self._urls}
    with concurrent.futures.ThreadPoolExecutor(min(_OPEN_THREADS, max(1, len(self._urls)))) as p:
      self._readers: list[ObjectShardReader] = list(p.map(self._open, self._urls))
    cache_fill.known(r.obj for r in self._readers)
    counts = np.asarray([r.num_records for r in self._readers], np.int64)
    self._key_ends = np.cumsum(counts)
    self._key_starts = self._key_ends - counts

  def _open(self, url: str) -> ObjectShardReader:
    recorded = self.identities.get(url)
    if not isinstance(recorded, identity_lib.ObjectIdentity):
      raise _not_recorded(url)
    obj = recorded.ref(url, self._storage, self.dataset)
    try:
      return open_object_shard(obj, recorded.tail_hash, identity_lib.IDENTITY_TAIL_BYTES)
    except UnsupportedShard as e:
      raise ConfigError(f"shard {url}: {e}; from a bucket only ArrayRecord's default "
                        "layout (simple chunks, zstd or uncompressed) is read: copy it to "
                        "local disk or rewrite it") from e
    except CorruptShard as e:
      raise DataLossError(f"shard {url} cannot be opened: {e}") from e

  def __len__(self) -> int:
    return int(self._key_ends[-1]) if len(self._key_ends) else 0

  def __getitem__(self, record_key: int) -> bytes:
    (record,) = self.read_raw([record_key])
    return record

  def _getitems(self, indices: Sequence[int]) -> Sequence[bytes]:
    return self.read_raw(indices)

  def _split(self, indices: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
    """shard -> (positions in it, places in `indices`)."""
    keys = np.asarray(indices, np.int64)
    if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
      raise ValueError(f"record keys must be in [0, {len(self)})")
    shards = np.searchsorted(self._key_ends, keys, "right")
    positions = keys - self._key_starts[shards]
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i, (shard, position) in enumerate(zip(shards.tolist(), positions.tolist())):
      group = out.setdefault(shard, ([], []))
      group[0].append(position)
      group[1].append(i)
    return out

  def where(self, key: int) -> str:
    """"shard URL record P": where the source's record `key` is stored."""
    shard = int(np.searchsorted(self._key_ends, key, "right"))
    return f"shard {self._urls[shard]} record {key - int(self._key_starts[shard])}"

  def needs(self, indices: Sequence[int]) -> list[tuple[objects_lib.ObjectRef, list[tuple[int, int]]]]:
    """What a read of the records at `indices` needs from the bucket: per
    object, its chunks' extents that the cache does not hold (what
    read_ahead.py plans)."""
    cache = cache_lib.current()
    if cache is None:
      return [(self._readers[shard].obj, self._readers[shard].extents(positions))
              for shard, (positions, _) in sorted(self._split(indices).items())]
    out = []
    for shard, (positions, _) in sorted(self._split(indices).items()):
      obj = self._readers[shard].obj
      if not cache.complete(obj):  # a whole object cached needs nothing from the bucket
        missing = cache.missing(obj, self._readers[shard].extents(positions))
        if missing:
          out.append((obj, missing))
    return out

  def plan(self, indices: Sequence[int]) -> list[tuple[objects_lib.ObjectRef, int, int]]:
    """Every byte range an unplanned read of the records at `indices` makes."""
    return [(obj, a, b) for obj, extents in self.needs(indices) for a, b in coalesce(extents)]

  def read_raw(self, indices: Sequence[int]) -> Sequence[bytes]:
    """The records' bytes as stored: their chunks from the read-ahead where
    it holds them, the others fetched now, concurrently."""
    groups = self._split(indices)
    ahead = read_ahead.current()
    cache = cache_lib.current()
    filler = cache_fill.current()
    views: dict[int, dict[int, Any]] = {}
    fetches: list[tuple[int, int, int, list[tuple[int, int]]]] = []  # shard, range, its chunks
    needed = 0
    for shard, (positions, _) in groups.items():
      reader = self._readers[shard]
      extents = reader.extents(positions)
      if cache is not None:
        local, extents = cache.take(reader.obj, extents)
        if extents and filler is not None:  # first touch: these blocks are filled first
          filler.touched(reader.obj, cache.missing_blocks(reader.obj, extents))
      needed += sum(b - a for a, b in extents)
      if extents:
        views[shard], missing = ahead.take(reader.obj, extents)
        if cache is not None:
          views[shard].update(local)
      else:  # all from the cache
        views[shard], missing = local, []
      chunks = iter(missing)
      for a, b in coalesce(missing):
        inside, chunk = [], next(chunks)
        while True:  # the missing extents in [a, b), in order
          inside.append(chunk)
          if chunk[1] >= b:
            break
          chunk = next(chunks)
        fetches.append((shard, a, b, inside))
    data = objects_lib.objects().fetch([(self._readers[s].obj, a, b) for s, a, b, _ in fetches])
    for (shard, begin, _, inside), got in zip(fetches, data):
      for a, b in inside:
        views[shard][a] = memoryview(got)[a - begin:b - begin]
    ahead.counts.storage_bytes(self.dataset, fetched=sum(len(d) for d in data), needed=needed)
    out: list[bytes] = [b""] * len(indices)
    for shard, (positions, where) in groups.items():
      try:
        records = self._readers[shard].read(positions, Fetched(views[shard]))
      except CorruptShard as e:
        raise DataLossError(f"shard {self._urls[shard]} is corrupt: {e}") from e
      for record, i in zip(records, where):
        out[i] = record
    return out
