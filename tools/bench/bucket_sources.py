"""The two ways local Grain reads a bucket today, as Grain data sources
(`len`, `__getitem__`), for `elevator bench --storage` (bench/buckets.py):

- PerRecordSource: each record read through a file-like object of its
  shard (fsspec's interface, obstore's implementation), as
  ArrayRecordDataSource reads a FUSE-mounted bucket (gcsfuse, mountpoint-s3):
  a seek and a read of the record's chunk, with ArrayRecordDataSource's own
  file buffer (FILE_BUFFER_BYTES); Grain's read threads give the concurrency.
  ArrayRecord's C++ reader opens only paths, so the chunk is decoded by the
  server's reader (server/data/shards/object_reader.py), which also keeps
  the footers, read once at start as ArrayRecord keeps its index.
- ShardCacheSource: whole shards downloaded into a bounded local cache and
  read there with ArrayRecord's reader (Mosaic Streaming's and LitData's
  pattern); the least recently used shard not being read is deleted past
  the limit. With `window_fraction`, the source has its own order, a
  windowed shuffle as those libraries make it: the shards in a random
  order, their records shuffled within windows of that fraction of the
  dataset, the next window's shards downloaded in the background while
  this one is read (its key k is the k-th record of that order: read it
  without Grain's global shuffle, which would undo the windows). Each
  shard's record count comes from its footer (Mosaic keeps an index file).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
import threading
from typing import Any, Sequence

# ArrayRecordDataSource's file_reader_buffer_size: the least one read asks for.
FILE_BUFFER_BYTES = 32 << 10


def _split(url: str) -> tuple[str, str]:
  bucket, _, key = url.split("://", 1)[1].partition("/")
  return bucket, key


class _Index:
  """Record key -> (shard, position in it), over shards of known sizes."""

  def __init__(self, counts: Sequence[int]):
    self._ends = list(_cumsum(counts))

  def __len__(self) -> int:
    return self._ends[-1] if self._ends else 0

  def locate(self, key: int) -> tuple[int, int]:
    import bisect  # pylint: disable=g-import-not-at-top
    shard = bisect.bisect_right(self._ends, key)
    return shard, key - (self._ends[shard - 1] if shard else 0)


def _cumsum(counts: Sequence[int]):
  total = 0
  for c in counts:
    total += c
    yield total


class PerRecordSource:
  """Per-record reads through file-like objects (module docstring)."""

  def __init__(self, urls: Sequence[str]):
    from obstore.fsspec import FsspecStore  # pylint: disable=g-import-not-at-top
    from grain_elevator.server.data.object_source import ObjectRecordSource  # pylint: disable=g-import-not-at-top
    self._urls = list(urls)
    self._readers = ObjectRecordSource(urls)._readers  # pylint: disable=protected-access
    self._index = _Index([r.num_records for r in self._readers])
    self._fs = FsspecStore("s3", client_options={"allow_http": True})
    self._local = threading.local()  # per read thread: its open files

  def __len__(self) -> int:
    return len(self._index)

  def _file(self, shard: int) -> Any:
    files = self._local.__dict__.setdefault("files", {})
    if shard not in files:
      files[shard] = self._fs.open("/".join(_split(self._urls[shard])), "rb",
                                   buffer_size=FILE_BUFFER_BYTES)
    return files[shard]

  def __getitem__(self, key: int) -> bytes:
    from grain_elevator.server.data.shards.object_reader import Fetched  # pylint: disable=g-import-not-at-top
    shard, position = self._index.locate(int(key))
    reader = self._readers[shard]
    ((begin, end),) = reader.extents([position])
    f = self._file(shard)
    f.seek(begin)
    data = f.read(end - begin)
    (record,) = reader.read([position], Fetched({begin: data}))
    return record


def windowed_order(counts: Sequence[int], window: int, seed: int = 0
                   ) -> tuple[list[int], list[list[int]]]:
  """A windowed shuffle of the records of shards of `counts` records:
  (every record key in the order read, the shards each window of `window`
  records reads from). The shards come in a random order, and the records
  of each window of `window` (in that order) are shuffled among themselves."""
  rng = random.Random(seed)
  starts = [0, *_cumsum(counts)][:-1]
  shards = list(range(len(counts)))
  rng.shuffle(shards)
  keys = [starts[s] + i for s in shards for i in range(counts[s])]
  of_key = {}
  for s in shards:
    for i in range(counts[s]):
      of_key[starts[s] + i] = s
  order: list[int] = []
  windows: list[list[int]] = []
  for at in range(0, len(keys), max(1, window)):
    part = keys[at:at + max(1, window)]
    windows.append(sorted({of_key[k] for k in part}, key=shards.index))
    rng.shuffle(part)
    order.extend(part)
  return order, windows


class ShardCacheSource:
  """Whole shards in a bounded local cache (module docstring)."""

  PREFETCH_THREADS = 2  # shard downloads on their way at once, ahead of the reads

  def __init__(self, urls: Sequence[str], cache_dir: str, limit_bytes: int,
               window_fraction: float = 0.0, seed: int = 0):
    import obstore  # pylint: disable=g-import-not-at-top
    from obstore.store import S3Store  # pylint: disable=g-import-not-at-top
    from grain_elevator.server.data.object_source import ObjectRecordSource  # pylint: disable=g-import-not-at-top
    self._urls = list(urls)
    self._dir = cache_dir
    self._limit = limit_bytes
    os.makedirs(cache_dir, exist_ok=True)
    bucket, _ = _split(self._urls[0])
    self._store = S3Store(bucket, client_options={"allow_http": True})
    self._get = obstore.get
    self._lock = threading.Lock()
    self._shard_locks = [threading.Lock() for _ in self._urls]
    self._readers: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._sizes: dict[int, int] = {}
    self._reading: collections.Counter[int] = collections.Counter()
    self.downloaded_bytes = 0
    counts = [r.num_records for r in ObjectRecordSource(urls)._readers]  # pylint: disable=protected-access
    self._index = _Index(counts)
    self._order: list[int] | None = None
    self._windows: list[list[int]] = []
    self._window = 0
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._asked: set[tuple[int, int]] = set()  # (epoch, window)s whose shards were asked for
    if window_fraction > 0:
      self._window = max(1, round(len(self._index) * window_fraction))
      self._order, self._windows = windowed_order(counts, self._window, seed)
      self._pool = concurrent.futures.ThreadPoolExecutor(self.PREFETCH_THREADS,
                                                         thread_name_prefix="shard-prefetch")

  def __len__(self) -> int:
    return len(self._index)

  def _download(self, shard: int) -> str:
    _, key = _split(self._urls[shard])
    path = os.path.join(self._dir, f"{shard:06d}.array_record")
    data = self._get(self._store, key).bytes()
    with open(path + ".part", "wb") as f:
      f.write(data)
    os.replace(path + ".part", path)
    with self._lock:
      self._sizes[shard] = len(data)
      self.downloaded_bytes += len(data)
    return path

  def _acquire(self, shard: int) -> Any:
    from grain_elevator.server.data import grain_private  # pylint: disable=g-import-not-at-top
    with self._lock:
      self._reading[shard] += 1
      reader = self._readers.get(shard)
      if reader is not None:
        self._readers.move_to_end(shard)
        return reader
    with self._shard_locks[shard]:  # one download of a shard at a time
      with self._lock:
        reader = self._readers.get(shard)
      if reader is None:
        reader = grain_private.array_record_reader(self._download(shard), "")
        with self._lock:
          self._readers[shard] = reader
          self._evict()
      return reader

  def _release(self, shard: int) -> None:
    with self._lock:
      self._reading[shard] -= 1
      self._evict()

  def _prefetch(self, shard: int) -> None:
    """In the background: the shard downloaded, not held for a read."""
    self._acquire(shard)
    self._release(shard)

  def _ahead(self, epoch: int, position: int) -> None:
    """The shards of this window and the next asked for, once each."""
    window = position // self._window
    nxt = (epoch, window + 1) if window + 1 < len(self._windows) else (epoch + 1, 0)
    for at in ((epoch, window), nxt):
      with self._lock:
        if at in self._asked:
          continue
        self._asked.add(at)
      for shard in self._windows[at[1]]:
        self._pool.submit(self._prefetch, shard)

  def _evict(self) -> None:
    """Past the limit: the least recently used shards no read holds go (under _lock)."""
    for shard in list(self._readers):
      if sum(self._sizes.get(s, 0) for s in self._readers) <= self._limit:
        return
      if self._reading[shard] > 0:
        continue
      self._readers.pop(shard).close()
      try:
        os.unlink(os.path.join(self._dir, f"{shard:06d}.array_record"))
      except OSError:
        pass

  def __getitem__(self, key: int) -> bytes:
    key = int(key)
    if self._order is not None:
      epoch, position = divmod(key, len(self._order))
      self._ahead(epoch, position)
      key = self._order[position]
    shard, position = self._index.locate(key)
    reader = self._acquire(shard)
    try:
      return reader.read([position])[0]
    finally:
      self._release(shard)
