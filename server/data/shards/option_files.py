"""Files a dataset's options name (a tokenizer, a vocabulary): part of its
identity, like its shards.

Which files: every string in a dataset's `options` or `iter_options`, at
any depth of arrays and tables, that names an existing regular file when
resolved as a pipeline resolves it (`grain_elevator.pipelines.config_path`:
`~` expanded, relative to the config file's folder; symlinks followed)
(`DatasetConfig.option_paths`). A folder is not one: name its files.

The supervisor records each once, at start-up, beside the shards
(`identity.record_identities`): its size, mtime, ctime, inode and a hash of
its whole content, read at one stable moment. A worker, a restarted one
too, checks each against the recording before it builds the dataset's
pipelines and again once its first record or batch is made; the
`iter_options` files also before each `iter_pipeline` is built (a stream
builds one for each position it serves). A file that changed refuses the
dataset on that worker with ShardChangedError (FAILED_PRECONDITION) naming
the file, while its other datasets are served: it is never built into the
stream under the old fingerprint. A worker that built its pipeline before
the change serves what it read then, as the fingerprint says. The
fingerprint covers each file's size and content hash (server/data/records.py):
a server started on another tokenizer has another, and refuses the old
one's cursors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Iterable, Mapping, Protocol

from grain_elevator.proto.errors import ConfigError, ShardChangedError

# How much of a file one read takes while it is hashed: memory stays
# bounded for a file of any size.
HASH_READ_BYTES = 1 << 20

_RESTART = ("restart the server to serve the file as it is now (the stream fingerprint "
            "changes with its content)")


class NamesFiles(Protocol):
  """A dataset as this module reads it (server/data/config.py's
  DatasetConfig is one): shards/ imports nothing above it, so it asks for
  these two and no more."""

  @property
  def name(self) -> str: ...

  def option_paths(self) -> list[tuple[str, str]]:
    """(where, path) of each string its options name, as a pipeline
    resolves it: "options.tokenizer" or "iter_options.vocab[1]"."""


@dataclasses.dataclass(frozen=True)
class FileIdentity:
  """What a file an option names was when the server started.

  As a shard's (identity.ShardIdentity): any write, rename or utime moves
  the ctime, which no user can set back, and the inode tells a file renamed
  over the name. The content hash covers every byte: the fingerprint is
  what the file holds, not where or when it was written.
  """

  size: int
  mtime_ns: int
  ctime_ns: int
  inode: int
  device: int
  content_hash: str  # blake2b-128 of the whole file

  def stat_key(self) -> tuple[int, ...]:
    return self.size, self.mtime_ns, self.ctime_ns, self.inode, self.device

  def differences(self, st: os.stat_result) -> str:
    """What moved, as the refusal says it: "size/mtime/ctime differ; 700 -> 716 bytes"."""
    names = [name for name, a, b in (
        ("size", self.size, st.st_size), ("mtime", self.mtime_ns, st.st_mtime_ns),
        ("ctime", self.ctime_ns, st.st_ctime_ns),
        ("inode", (self.device, self.inode), (st.st_dev, st.st_ino))) if a != b]
    sizes = f"; {self.size} -> {st.st_size} bytes" if st.st_size != self.size else ""
    return f"{'/'.join(names) or 'nothing'} differ{'s' if len(names) < 2 else ''}{sizes}"


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
  return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def file_identity(path: str) -> FileIdentity:
  """`path`'s identity now: stat, hash every byte, stat again, so a file
  still being written is refused rather than recorded half-way. ConfigError
  names a file that cannot be read."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError as e:
    raise ConfigError(f"file {path} cannot be opened: {e}") from e
  try:
    for _ in range(3):
      before = os.fstat(fd)
      digest = hashlib.blake2b(digest_size=16)
      offset = 0
      while chunk := os.pread(fd, HASH_READ_BYTES, offset):
        digest.update(chunk)
        offset += len(chunk)
      after = os.fstat(fd)
      if offset == before.st_size and _stat_key(before) == _stat_key(after):
        return FileIdentity(after.st_size, after.st_mtime_ns, after.st_ctime_ns,
                            after.st_ino, after.st_dev, digest.hexdigest())
  except OSError as e:
    raise ConfigError(f"file {path} cannot be read: {e}") from e
  finally:
    os.close(fd)
  raise ConfigError(f"file {path} kept changing while it was read: is it still being written?")


def named_files(config: NamesFiles) -> set[str]:
  """The files `config`'s options name now."""
  return {path for _, path in config.option_paths() if os.path.isfile(path)}


def record_files(datasets: Iterable[NamesFiles]) -> dict[str, FileIdentity]:
  """Every file any of `datasets`' options name, by absolute path: what
  the supervisor records at start-up with the shards."""
  files: set[str] = set()
  for dataset in datasets:
    files |= named_files(dataset)
  return {path: file_identity(path) for path in sorted(files)}


@dataclasses.dataclass(frozen=True)
class NamedFile:
  where: str  # the option, as "options.tokenizer" or "iter_options.vocab[1]"
  path: str
  identity: FileIdentity


class OptionFiles:
  """The files one dataset's options name, each with its recorded identity.

  `recorded`: the supervisor's recording (`record_files`); None records
  them now (embedded mode, which opens a dataset on first use). A string
  that names a file now but named none when the server started is refused
  here: the pipeline would read a file the fingerprint does not cover.
  """

  def __init__(self, config: NamesFiles, recorded: Mapping[str, FileIdentity] | None):
    self.dataset = config.name
    files: list[NamedFile] = []
    for where, path in config.option_paths():
      identity = None if recorded is None else recorded.get(path)
      if identity is None:
        if not os.path.isfile(path):
          continue
        if recorded is not None:
          raise ShardChangedError(
              f"dataset {self.dataset!r}: file {path} ({where}) was not a file when the "
              f"server started; {_RESTART}")
        identity = file_identity(path)
      files.append(NamedFile(where, path, identity))
    self.files = tuple(files)

  def check(self, section: str | None = None) -> None:
    """Refuses the dataset if a file (of `section`, "options" or
    "iter_options"; None: all) is not the one recorded: one stat each."""
    for f in self.files:
      if section is not None and not f.where.startswith(section + "."):
        continue
      try:
        st = os.stat(f.path)
      except OSError as e:
        raise ShardChangedError(
            f"dataset {self.dataset!r}: file {f.path} ({f.where}) changed since the server "
            f"started: it cannot be read now ({e.strerror}); {_RESTART}") from None
      if _stat_key(st) != f.identity.stat_key():
        raise ShardChangedError(
            f"dataset {self.dataset!r}: file {f.path} ({f.where}) changed since the server "
            f"started ({f.identity.differences(st)}); {_RESTART}")

  def fingerprint_fields(self) -> dict[str, list[int | str]]:
    """What the fingerprint covers: each option's file by its size and content."""
    return {f.where: [f.identity.size, f.identity.content_hash] for f in self.files}
