"""A server's cache of bucket objects on its own disks (`--cache-dir`,
`--cache-mb`), shared by its workers, kept across restarts.

Small records are the wrong unit for GETs at any depth: 3 KB records cost
$133 per TB in GETs, a store refuses past ~5,000 a second, and coalescing
does not help under a global shuffle. So a data tier whose disks can hold a
dataset reads it once, in BLOCK_BYTES ranges (in the background from start,
and a block first when a read touches it: cache_fill.py), and from then on
its records are read locally. A cache that holds part of a dataset serves
what it holds and the rest is read by plan, as without it.

Layout: `<dir>/objects/<url digest>/<identity digest>/` holds one object's
blocks, `b<i>` for bytes [i * BLOCK_BYTES, (i + 1) * BLOCK_BYTES), and
`object.json` (its URL, size, ETag and generation). The identity is the one
the server recorded at start (size and ETag or generation), so a replaced
object is another folder: its old blocks are never read for it, and are
removed when the server opens the new identity. A block is written as
`b<i>.<pid>.tmp`, synced and renamed: a block file exists whole or not at
all, and a block whose size is not its own is dropped when read. One server
per folder: the workers of one server share it, through `<dir>/lock`.

Bounded: the blocks, and the blocks being filled, stay within `limit_bytes`
(`usage` in `<dir>/usage`, recounted from the files when a worker opens the
cache); a full cache stops filling and serves what it holds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import threading
import time
from typing import Iterator, Sequence

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.storage.objects import ObjectRef

# What one fill reads and one block file holds: large enough that a GET's
# cost and wait are small beside its transfer (S3 and GCS stream ~55 MiB/s
# a connection: 8 MiB is ~0.15 s), small enough that a partly read object
# is mostly cached.
BLOCK_BYTES = 8 << 20
# A block that was missing is looked for again on disk (another worker may
# have filled it) at most this often per object.
RESCAN_S = 0.5
# Open block files kept per process.
MAX_OPEN_FILES = 256
# A claim to fill a block older than this is a dead filler's (a live one
# finishes a block in seconds).
STALE_CLAIM_S = 600.0


class Counts:
  """What the cache reports (the server's metrics implement it). Here: nothing."""

  def cache_read(self, dataset: str, *, hit_bytes: int, miss_bytes: int) -> None:
    pass

  def cache_filled(self, dataset: str, nbytes: int) -> None:
    pass

  def object_cache_bytes(self, nbytes: int, wanted: int) -> None:
    pass


def _digest(*parts: object) -> str:
  return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def cacheable(obj: ObjectRef) -> bool:
  """Whether a replaced copy of `obj` could be told apart: it has an ETag
  or a generation."""
  return obj.etag is not None or obj.version is not None


@dataclasses.dataclass
class _Object:
  """One object's blocks in this process's view."""

  folder: pathlib.Path
  blocks: int
  held: bytearray  # 1 where a whole block file is on disk
  scanned_at: float = 0.0
  complete: bool = False  # every block held: no read of it goes to the bucket


class ObjectCache:
  """The cache in one process. Thread-safe (`_lock`); across the server's
  processes, the files and `<dir>/lock` are what is shared."""

  def __init__(self, root: str | os.PathLike, limit_bytes: int, counts: Counts | None = None):
    self.root = pathlib.Path(root)
    self.limit_bytes = limit_bytes
    self.counts = counts or Counts()
    (self.root / "objects").mkdir(parents=True, exist_ok=True)
    self._lock = threading.Lock()
    self._objects: dict[ObjectRef, _Object] = {}
    self._files: collections.OrderedDict[tuple[pathlib.Path, int], int] = (
        collections.OrderedDict())
    self.recount()

  # -- usage, shared by the server's processes ----------------------------------

  @contextlib.contextmanager
  def _shared(self) -> Iterator[pathlib.Path]:
    """Holds `<dir>/lock` (between processes), yields the usage file's path."""
    with open(self.root / "lock", "a+b") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        yield self.root / "usage"
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  def recount(self) -> int:
    """Counts the blocks on disk and the fills claimed by live processes
    (a dead filler's claim and partial file are removed); returns the bytes."""
    with self._shared() as usage:
      total = 0
      for folder in (self.root / "objects").glob("*/*"):
        entries = list(os.scandir(folder))
        listed = {e.name for e in entries}
        for entry in entries:
          name = entry.name
          if name.startswith("b") and name[1:].isdigit():
            with contextlib.suppress(OSError):  # dropped since the listing
              total += entry.stat().st_size
          elif name.endswith(".claim"):
            claim = pathlib.Path(entry.path)
            claimed = _claimed_bytes(claim)
            block = folder / name[:-len(".claim")]
            if block.name in listed:
              pass  # filled, and its block counted, just before the claim's end
            elif claimed is not None:
              total += claimed
            elif claim.exists():
              _remove(claim)  # a dead filler's
            elif block.exists():  # filled since the listing: its block was not listed
              total += block.stat().st_size
          elif name.endswith(".tmp") and not _alive(name.split(".")[-2]):
            _remove(pathlib.Path(entry.path))
      usage.write_text(str(total))
      return total

  def usage(self) -> int:
    with self._shared() as usage:
      return _read_usage(usage)

  def _reserve(self, nbytes: int) -> bool:
    with self._shared() as usage:
      used = _read_usage(usage)
      if used + nbytes > self.limit_bytes:
        return False
      usage.write_text(str(used + nbytes))
      return True

  def _unreserve(self, nbytes: int) -> None:
    with self._shared() as usage:
      usage.write_text(str(max(0, _read_usage(usage) - nbytes)))

  # -- objects ---------------------------------------------------------------------

  def _object(self, obj: ObjectRef) -> _Object:
    """`obj`'s blocks (its folder made, another identity's removed)."""
    got = self._objects.get(obj)
    if got is not None:
      return got
    parent = self.root / "objects" / _digest(obj.url)
    folder = parent / _digest(obj.url, obj.size, obj.etag, obj.version)
    meta = {"url": obj.url, "size": obj.size, "etag": obj.etag, "version": obj.version}
    if parent.is_dir():
      for other in parent.iterdir():
        if other != folder:  # the object was replaced: its old blocks are worthless
          self._unreserve(_blocks_bytes(other))
          shutil.rmtree(other, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    written = folder / "object.json"
    try:
      recorded = json.loads(written.read_text())
    except FileNotFoundError:
      recorded = None
    except ValueError:  # torn: written by a process that died
      recorded = {}
    if recorded is not None and recorded != meta:
      self._unreserve(_blocks_bytes(folder))
      for stale in folder.iterdir():
        _remove(stale)
    if recorded != meta:
      tmp = folder / f"object.json.{os.getpid()}.tmp"
      tmp.write_text(json.dumps(meta))
      os.replace(tmp, written)
    blocks = -(-obj.size // BLOCK_BYTES)
    got = self._objects[obj] = _Object(folder, blocks, bytearray(blocks))
    self._scan(got, time.monotonic())
    return got

  def _scan(self, o: _Object, now: float) -> None:
    for name in os.listdir(o.folder):
      if name.startswith("b") and name[1:].isdigit() and int(name[1:]) < o.blocks:
        o.held[int(name[1:])] = 1
    o.scanned_at = now
    o.complete = all(o.held)

  def complete(self, obj: ObjectRef) -> bool:
    """Whether every block of `obj` is held (then nothing of it is planned)."""
    if not cacheable(obj):
      return False
    with self._lock:
      o = self._object(obj)
      if not o.complete and time.monotonic() - o.scanned_at >= RESCAN_S:
        self._scan(o, time.monotonic())
      return o.complete

  def block_size(self, obj: ObjectRef, block: int) -> int:
    return min(BLOCK_BYTES, obj.size - block * BLOCK_BYTES)

  def held_blocks(self, obj: ObjectRef) -> tuple[int, int]:
    """(blocks held, blocks) of `obj`."""
    with self._lock:
      o = self._object(obj)
      now = time.monotonic()
      if now - o.scanned_at >= RESCAN_S:
        self._scan(o, now)
      return sum(o.held), o.blocks

  def _holds(self, o: _Object, begin: int, end: int, now: float) -> bool:
    first, last = begin // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
    if all(o.held[first:last + 1]):
      return True
    if now - o.scanned_at >= RESCAN_S:
      self._scan(o, now)
      return all(o.held[first:last + 1])
    return False

  def missing(self, obj: ObjectRef, extents: Sequence[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """The extents whose blocks are not all on disk (what a plan must read)."""
    if not cacheable(obj):
      return list(extents)
    now = time.monotonic()
    with self._lock:
      o = self._object(obj)
      return [(a, b) for a, b in extents if not self._holds(o, a, b, now)]

  def missing_blocks(self, obj: ObjectRef, extents: Sequence[tuple[int, int]]) -> list[int]:
    """The blocks these extents touch that are not on disk (what to fill)."""
    if not cacheable(obj):
      return []
    now = time.monotonic()
    with self._lock:
      o = self._object(obj)
      blocks = sorted({b for a, e in extents for b in range(a // BLOCK_BYTES,
                                                            (e - 1) // BLOCK_BYTES + 1)})
      if not all(o.held[b] for b in blocks) and now - o.scanned_at >= RESCAN_S:
        self._scan(o, now)
      return [b for b in blocks if not o.held[b]]

  # -- reading -----------------------------------------------------------------------

  def take(self, obj: ObjectRef, extents: Sequence[tuple[int, int]]
           ) -> tuple[dict[int, bytes], list[tuple[int, int]]]:
    """The extents the cache holds, read from disk, by begin; and those it
    does not (to read from the bucket)."""
    if not cacheable(obj):
      return {}, list(extents)
    got: dict[int, bytes] = {}
    missing: list[tuple[int, int]] = []
    now = time.monotonic()
    with self._lock:
      o = self._object(obj)
      files, folder, complete, held = self._files, o.folder, o.complete, o.held
      for begin, end in extents:
        block = begin // BLOCK_BYTES
        if (end - 1) // BLOCK_BYTES == block and (complete or held[block]):
          # The common case, a chunk inside one held block: one pread.
          fd = files.get((folder, block))
          if fd is None:
            fd = self._fd(obj, o, block)
          if fd is not None:
            data = os.pread(fd, end - begin, begin - block * BLOCK_BYTES)
            if len(data) == end - begin:
              got[begin] = data
              continue
        data = self._read(obj, o, begin, end) if self._holds(o, begin, end, now) else None
        if data is None:
          missing.append((begin, end))
        else:
          got[begin] = data
    hit = sum(len(d) for d in got.values())
    self.counts.cache_read(obj.dataset, hit_bytes=hit,
                           miss_bytes=sum(b - a for a, b in missing))
    return got, missing

  def _read(self, obj: ObjectRef, o: _Object, begin: int, end: int) -> bytes | None:
    """[begin, end) from the block files, or None (a block file vanished or
    has the wrong size: it is dropped, and the read goes to the bucket)."""
    parts = []
    position = begin
    while position < end:
      block = position // BLOCK_BYTES
      offset = position - block * BLOCK_BYTES
      n = min(end, (block + 1) * BLOCK_BYTES) - position
      fd = self._fd(obj, o, block)
      data = os.pread(fd, n, offset) if fd is not None else b""
      if len(data) != n:
        self._drop(o, block)
        return None
      parts.append(data)
      position += n
    return parts[0] if len(parts) == 1 else b"".join(parts)

  def _fd(self, obj: ObjectRef, o: _Object, block: int) -> int | None:
    key = (o.folder, block)
    fd = self._files.get(key)
    if fd is not None:
      self._files.move_to_end(key)
      return fd
    try:
      fd = os.open(o.folder / f"b{block}", os.O_RDONLY)
    except FileNotFoundError:
      o.held[block] = 0
      o.complete = False
      return None
    if os.fstat(fd).st_size != self.block_size(obj, block):
      os.close(fd)
      return None
    self._files[key] = fd
    while len(self._files) > MAX_OPEN_FILES:
      os.close(self._files.popitem(last=False)[1])
    return fd

  def _drop(self, o: _Object, block: int) -> None:
    o.complete = False
    fd = self._files.pop((o.folder, block), None)
    if fd is not None:
      os.close(fd)
    path = o.folder / f"b{block}"
    with contextlib.suppress(OSError):
      size = path.stat().st_size
      path.unlink()
      self._unreserve(size)
    o.held[block] = 0

  # -- filling (cache_fill.py) -------------------------------------------------------

  def claim(self, obj: ObjectRef, block: int) -> str:
    """Whether this process is to fill `block`: "mine" (claimed, its bytes
    reserved), "held" (on disk), "busy" (another process fills it) or
    "full" (no room within the limit)."""
    if not cacheable(obj):
      return "held"  # nothing to fill: its reads go to the bucket
    with self._lock:
      o = self._object(obj)
      if o.held[block] or (o.folder / f"b{block}").exists():
        o.held[block] = 1
        return "held"
      size = self.block_size(obj, block)
      claim = o.folder / f"b{block}.claim"
    try:
      fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      if _claimed_bytes(claim) is not None:
        return "busy"
      _remove(claim)  # a dead filler's: take it over
      try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        return "busy"
    if (o.folder / f"b{block}").exists():  # filled by another as this claim was made
      os.close(fd)
      _remove(claim)
      return "held"
    # Reserved before the claim says its size: a recount in between counts it once.
    reserved = self._reserve(size)
    with os.fdopen(fd, "w") as f:
      f.write(f"{os.getpid()} {size}" if reserved else "")
    if not reserved:
      _remove(claim)
      return "full"
    return "mine"

  def fill(self, obj: ObjectRef, block: int, data: bytes | memoryview | None) -> None:
    """Ends this process's claim of `block`: writes `data` (its bytes, read
    pinned to `obj`) or, if None (the read failed), lets the block go."""
    with self._lock:
      o = self._object(obj)
    size = self.block_size(obj, block)
    claim = o.folder / f"b{block}.claim"
    tmp = o.folder / f"b{block}.{os.getpid()}.tmp"
    try:
      if data is None or len(data) != size:
        self._unreserve(size)
        return
      try:
        with open(tmp, "wb") as f:
          f.write(data)
          f.flush()
          os.fsync(f.fileno())
        os.replace(tmp, o.folder / f"b{block}")
      except OSError:  # a full or failing disk: the block stays unheld
        _remove(tmp)
        self._unreserve(size)
        raise
      with self._lock:
        o.held[block] = 1
        o.complete = all(o.held)
      self.counts.cache_filled(obj.dataset, size)
    finally:
      _remove(claim)

  def close(self) -> None:
    with self._lock:
      for fd in self._files.values():
        os.close(fd)
      self._files.clear()


def _blocks_bytes(folder: pathlib.Path) -> int:
  """The bytes of the whole blocks in an object's folder."""
  total = 0
  with contextlib.suppress(OSError):
    for entry in os.scandir(folder):
      if entry.name.startswith("b") and entry.name[1:].isdigit():
        with contextlib.suppress(OSError):
          total += entry.stat().st_size
  return total


def _read_usage(path: pathlib.Path) -> int:
  try:
    return int(path.read_text() or 0)
  except (OSError, ValueError):
    return 0


def _alive(pid: str) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ValueError, ProcessLookupError):
    return False
  except PermissionError:
    return True
  return True


def _claimed_bytes(claim: pathlib.Path) -> int | None:
  """The bytes a live filler's claim reserves; None for a dead one's."""
  try:
    age = time.time() - claim.stat().st_mtime
    words = claim.read_text().split()
  except OSError:
    return None
  if len(words) != 2:  # being written (just made) or torn by a crash
    return 0 if age < 5.0 else None
  pid, size = words
  if age > STALE_CLAIM_S or not _alive(pid) or not size.isdigit():
    return None
  return int(size)


def _remove(path: pathlib.Path) -> None:
  with contextlib.suppress(OSError):
    path.unlink()


# What an automatic limit leaves of the disk's free space.
FREE_SPACE_KEPT = 0.1


def open_cache(root: str | os.PathLike, limit_mb: int | None,
               counts: Counts | None = None) -> ObjectCache:
  """This process's cache at `root`, within `limit_mb` MiB (None: what it
  holds plus 90% of its disk's free space). ConfigError names a folder
  that cannot be made or written."""
  try:
    pathlib.Path(root).mkdir(parents=True, exist_ok=True)
    probe = pathlib.Path(root) / f".probe.{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"--cache-dir {root}: cannot write there ({e.strerror})") from e
  cache = configure(root, 0 if limit_mb is None else limit_mb << 20, counts)
  assert cache is not None
  if limit_mb is None:
    free = shutil.disk_usage(root).free
    cache.limit_bytes = cache.usage() + int(free * (1 - FREE_SPACE_KEPT))
  return cache


_current: ObjectCache | None = None


def current() -> ObjectCache | None:
  """This process's cache (None: no --cache-dir)."""
  return _current


def configure(root: str | os.PathLike | None, limit_bytes: int,
              counts: Counts | None = None) -> ObjectCache | None:
  """Opens this process's cache (None: off)."""
  global _current
  if _current is not None:
    _current.close()
  _current = ObjectCache(root, limit_bytes, counts) if root else None
  return _current
