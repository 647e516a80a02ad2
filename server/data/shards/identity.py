"""A shard's identity: what the file or object was when the server started.

A shard replaced while the server runs must never change what a step holds
under one stream fingerprint, whichever worker answers and whenever it
opened the file. So each shard's identity (size, mtime, ctime, inode, a
hash of its tail) is recorded once, at start-up (`record_identities`, which
the supervisor hands to every worker it starts, then or later), the
fingerprint covers what the bytes are (server/data/records.py), and a worker
reads a shard only through a `CheckedFile` that still matches it; otherwise
ShardChangedError (FAILED_PRECONDITION) names the file. The files a
dataset's options name (a tokenizer) are recorded with them
(option_files.py).

A shard in a bucket (gs://, s3://) is recorded as its size, ETag and
generation (`ObjectIdentity`), and every read of it is pinned to them
(server/data/storage/objects.py): a replaced object answers 412 or 404,
which is ShardChangedError naming it, never other bytes. Both kinds hash
their last IDENTITY_TAIL_BYTES the same way, and the fingerprint covers only
the size and that hash: a copy of the same bytes, on disk or in another
bucket, is the same stream.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Iterable, Mapping, Protocol, Sequence

from grain_elevator.proto.errors import ConfigError, ElevatorError, ShardChangedError
from grain_elevator.server.data.shards import option_files
from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage import urls
from grain_elevator.server.data.storage.settings import StorageSettings

# How much of a shard's end its identity hashes: ArrayRecord's postscript
# (the last 64 KiB block) and the 64 KiB before it, the end of the footer,
# which lists every chunk's offset. A rewrite that changes any chunk's size
# moves every later offset, so these last entries change too; a small shard
# is hashed whole. A rewrite that keeps every size (fixed-size records,
# uncompressed) leaves the tail as it was, but not the mtime. Bounded, so a
# shard of any size costs one 128 KiB read and hash (~0.15 ms from the page
# cache).
IDENTITY_TAIL_BYTES = 2 * shard_reader.BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class ShardIdentity:
  """What a shard file was when the server started.

  A write moves the size or mtime, but a user can put the mtime back
  (os.utime, touch -d, cp -p, rsync -a); the ctime no user can set, and any
  write, utime or rename moves it. The inode and device tell a file renamed
  over the shard from the file itself. The tail hash catches a copy of
  another shard's size that kept every timestamp. So a shard is refused once
  any of these moved, after a chmod, chown or new hard link too (each moves
  the ctime): refusing is safe, and a restart records the file anew. The
  stream fingerprint covers the size, mtime and tail only
  (server/data/records.py): what the bytes are, not where they sit, so a copy on
  another machine fingerprints the same.
  """

  size: int
  mtime_ns: int
  tail_hash: str  # blake2b-128 of the last IDENTITY_TAIL_BYTES
  ctime_ns: int
  inode: int
  device: int

  @classmethod
  def of_stat(cls, st: os.stat_result, tail_hash: str) -> "ShardIdentity":
    return cls(st.st_size, st.st_mtime_ns, tail_hash, st.st_ctime_ns, st.st_ino, st.st_dev)

  def differences(self, now: "ShardIdentity") -> str:
    """What changed, as the refusal says it: "size/mtime/ctime differ; 70000 -> 70016 bytes"."""
    names = [name for name, a, b in (
        ("size", self.size, now.size), ("mtime", self.mtime_ns, now.mtime_ns),
        ("ctime", self.ctime_ns, now.ctime_ns),
        ("inode", (self.device, self.inode), (now.device, now.inode)),
        ("footer", self.tail_hash, now.tail_hash)) if a != b]
    sizes = f"; {self.size} -> {now.size} bytes" if now.size != self.size else ""
    return f"{'/'.join(names) or 'nothing'} differ{'s' if len(names) < 2 else ''}{sizes}"


@dataclasses.dataclass(frozen=True)
class ObjectIdentity:
  """What a shard object was when the server started: its size and the hash
  of its tail (as a file's, `ShardIdentity`: what the stream fingerprint
  covers), and the ETag and generation (or S3 version) every read is pinned
  to."""

  size: int
  tail_hash: str
  etag: str | None
  version: str | None

  def ref(self, url: str, settings: StorageSettings, dataset: str = "") -> objects_lib.ObjectRef:
    return objects_lib.ObjectRef(url, settings, self.size, self.etag, self.version, dataset)


def tail_hash(tail: bytes) -> str:
  return hashlib.blake2b(tail, digest_size=16).hexdigest()


def object_identity(url: str, settings: StorageSettings) -> ObjectIdentity:
  """The object's identity now: one HEAD and one ranged read of its tail,
  pinned to what the HEAD saw. Raises what objects.py raises."""
  store = objects_lib.objects()
  head = store.head(url, settings)
  n = min(head.size, IDENTITY_TAIL_BYTES)
  (tail,) = store.fetch([(head, head.size - n, head.size)]) if n else (b"",)
  return ObjectIdentity(head.size, tail_hash(tail), head.etag, head.version)


def _identity_of_object(dataset: str, url: str, settings: StorageSettings) -> ObjectIdentity:
  try:
    return object_identity(url, settings)
  except ConfigError:
    raise
  except ShardChangedError as e:  # replaced between its HEAD and its tail's read
    raise ConfigError(f"dataset {dataset!r}: shard {url} changed while its identity was "
                      "read: is it still being written?") from e
  except ElevatorError as e:  # the tail's read: past the retry budget, access lost
    raise ConfigError(f"dataset {dataset!r}: cannot read {url}: {e}") from e
  except Exception as e:  # pylint: disable=broad-except
    raise objects_lib.start_error(dataset, url, e, "read") from e


def _changed(filename: str, what: str) -> ShardChangedError:
  return ShardChangedError(
      f"shard {filename} changed since the server started ({what}): restart the "
      "server to serve the new data; the stream fingerprint will change")


def identity_of(fd: int, filename: str) -> ShardIdentity:
  """The identity of the open file `fd`. Its stat and tail come from one
  stable moment (stat, read, stat again), so a file still being written is
  refused rather than recorded half-way."""
  for _ in range(3):
    before = os.fstat(fd)
    n = min(before.st_size, IDENTITY_TAIL_BYTES)
    tail = os.pread(fd, n, before.st_size - n)
    after = os.fstat(fd)
    if len(tail) == n and _stat_key(before) == _stat_key(after):
      return ShardIdentity.of_stat(after, tail_hash(tail))
  raise ShardChangedError(f"shard {filename} kept changing while it was read: is it "
                          "still being written?")


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
  return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def _identity_of_path(filename: str) -> ShardIdentity:
  try:
    fd = os.open(filename, os.O_RDONLY | os.O_CLOEXEC)
  except OSError as e:
    raise ConfigError(f"shard {filename} cannot be opened: {e}") from e
  try:
    return identity_of(fd, filename)
  except ShardChangedError as e:
    raise ConfigError(str(e)) from e
  finally:
    os.close(fd)


def shard_identities(files: Iterable[str], *, dataset: str = "",
                     storage: StorageSettings | None = None
                     ) -> dict[str, ShardIdentity | ObjectIdentity]:
  """Each file's or object's identity, read now (a few at a time: on
  network storage an open is a round trip; objects 64 at a time). ConfigError
  names a shard that cannot be read (and for an object, the dataset)."""
  files = sorted(set(files))
  settings = storage or StorageSettings()

  def one(f: str) -> ShardIdentity | ObjectIdentity:
    return _identity_of_object(dataset, f, settings) if urls.is_url(f) else _identity_of_path(f)
  threads = 64 if any(urls.is_url(f) for f in files) else 16
  with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
    return dict(zip(files, pool.map(one, files)))


@dataclasses.dataclass(frozen=True)
class Recorded:
  """What the supervisor records once at start-up and hands to each worker
  it starts, then or later: every dataset's shards, and the files their
  options name, each by absolute path."""

  shards: dict[str, ShardIdentity | ObjectIdentity]
  files: dict[str, option_files.FileIdentity]


class ShardedDataset(option_files.NamesFiles, Protocol):
  """A dataset as `record_identities` reads it (server/data/config.py's
  DatasetConfig is one): its name, shards, storage and option files."""

  @property
  def files(self) -> Sequence[str]: ...

  @property
  def storage(self) -> StorageSettings | None: ...


class DatasetRegistry(Protocol):
  """A config's datasets by name (server/data/config.py's ServerConfig is one)."""

  @property
  def datasets(self) -> Mapping[str, ShardedDataset]: ...


def record_identities(config: DatasetRegistry) -> Recorded:
  """The shards and option files of every dataset, as they are now."""
  shards: dict[str, ShardIdentity | ObjectIdentity] = {}
  for d in config.datasets.values():
    todo = [f for f in d.files if f not in shards]
    if todo:
      shards.update(shard_identities(todo, dataset=d.name, storage=d.storage))
  return Recorded(shards, option_files.record_files(config.datasets.values()))


class CheckedFile:
  """A shard file opened once and checked against its recorded identity.

  Readers then open `path`, which on Linux names this very open file
  (/proc/self/fd/N): a rename-replace between the check and their open
  cannot slip another file in. A rename-replace later is harmless: the open
  file keeps the bytes that were checked and this worker goes on serving
  them, as the fingerprint says. A write into the file itself is not, so
  `check` (one fstat, ~2 µs) runs after every read of it and refuses once
  its size, mtime or ctime moved (a write moves the ctime even where the
  writer put the size and mtime back). A rename over the file or its
  deletion moves its ctime too and leaves the bytes this worker serves; it
  drops the link count, and from then on only the size and mtime are
  compared.
  """

  def __init__(self, filename: str, recorded: ShardIdentity | None):
    self.filename = filename
    self._fd = os.open(filename, os.O_RDONLY | os.O_CLOEXEC)
    try:
      if recorded is None:
        raise ShardChangedError(
            f"shard {filename} was not among the dataset's files when the server "
            "started: restart the server to serve it; the stream fingerprint will change")
      now = identity_of(self._fd, filename)
      if now != recorded:
        raise _changed(filename, recorded.differences(now))
    except BaseException:
      os.close(self._fd)
      raise
    self._recorded = recorded
    self._stat = (recorded.size, recorded.mtime_ns, recorded.ctime_ns, recorded.inode,
                  recorded.device)
    self._links = os.fstat(self._fd).st_nlink
    proc = f"/proc/self/fd/{self._fd}"
    self.path = proc if os.path.exists(proc) else filename

  def confirm_opened(self) -> None:
    """After a reader opened `path`: where that is the file's name (no
    /proc), the name must still lead to the file that was checked."""
    if self.path == self.filename:
      st, named = os.fstat(self._fd), os.stat(self.filename)
      if (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino):
        raise _changed(self.filename, "the file under its name differs")

  def check(self) -> None:
    """Refuses a file written to since it was checked (its stat moved)."""
    st = os.fstat(self._fd)
    # Renamed over or deleted (fewer links): that moved the ctime, not the bytes.
    ctime = st.st_ctime_ns if st.st_nlink >= self._links else self._recorded.ctime_ns
    if (st.st_size, st.st_mtime_ns, ctime, st.st_ino, st.st_dev) != self._stat:
      now = dataclasses.replace(ShardIdentity.of_stat(st, self._recorded.tail_hash),
                                ctime_ns=ctime)
      raise _changed(self.filename, self._recorded.differences(now))

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass
