"""The shard reader Grain sees: an ArrayRecordDataSource with a batched read.

Grain calls a source's `_getitems` for a batch's records; this one reads each
shard's share of them in one call to server/data/shards/reader.py, opening shards
only through their checked identity (server/data/shards/identity.py) when the
server gives it one.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from grain_elevator.proto.errors import DataLossError, ShardChangedError
from grain_elevator.server.data import grain_private
from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server.data.shards.identity import CheckedFile, ShardIdentity

log = logging.getLogger("grain_elevator.server")

# Where ArrayRecord reads a shard (server/data/shards/reader.py does not decode
# it): its batched read hands positions to a thread pool, which for small
# records beats ~55 µs per call, but from about this size a call per record
# reads as fast on ~35% less CPU (BENCHMARKS.md).
SINGLE_READ_RECORD_BYTES = 64 << 10


_UNOPENED = object()


def _raise_for_first_bad_record(filename: str, positions: Sequence[int],
                                read_one: Any, errors: type[Exception] | tuple) -> None:
  """After a batch failed (rare): re-reads its records one by one and raises
  DataLossError naming the first that fails."""
  for p in positions:
    try:
      read_one(p)
    except errors as e:  # pylint: disable=broad-except
      raise DataLossError(
          f"shard {filename} is corrupt: record {p} cannot be read: {e}") from e


class BatchedArrayRecordSource(grain.sources.ArrayRecordDataSource):
  """ArrayRecordDataSource that opts in to Grain's batched-read path.

  Grain calls `_getitems` on sources that offer it. Each shard's positions
  are read in the calling thread by `shard_reader.ShardReader` (one pread
  per chunk, riegeli's hashes checked; ~5 µs of CPU per small record against
  ~20 through ArrayRecord). Shards it does not decode, and builds without
  its C part, go through ArrayRecord: one call per shard, or one per record
  for records of SINGLE_READ_RECORD_BYTES and up (its batched call starts a
  thread pool, which on a few cores costs more than it saves).

  With `identities` (what the server serves), either reader opens a shard
  only through a `CheckedFile` that matched its recorded identity, and each
  read is followed by that file's fstat check: a changed shard is refused
  (ShardChangedError), never read. Without them (tools, tests that damage
  files on purpose) shards are read unchecked.
  """

  _single_reads: bool | None = None

  def __init__(self, paths: Any, reader_options: dict[str, str] | None = None, *,
               identities: Mapping[str, ShardIdentity | None] | None = None):
    super().__init__(paths, reader_options)
    self._identities = identities
    self._shards: list[Any] = [_UNOPENED] * len(self._read_instructions)
    self._files: list[CheckedFile | None] = [None] * len(self._read_instructions)
    self._index_shards()

  def _index_shards(self) -> None:
    """Where each shard's keys end, and key -> position shift, for `_split`."""
    counts = np.asarray([i.num_records for i in self._read_instructions], np.int64)
    starts = np.asarray([i.start for i in self._read_instructions], np.int64)
    self._key_ends = np.cumsum(counts)
    self._key_shift = self._key_ends - counts - starts

  def _reads_singly(self) -> bool:
    if self._single_reads is None:
      try:
        total = sum(os.path.getsize(i.filename) for i in self._read_instructions)
        self._single_reads = total >= SINGLE_READ_RECORD_BYTES * max(1, len(self))
      except (AttributeError, OSError):
        self._single_reads = False
    return self._single_reads

  def __getstate__(self):
    state = super().__getstate__()
    del state["_shards"]  # open file descriptors: reopened (and checked) lazily
    del state["_files"]
    return state

  def __setstate__(self, state):
    super().__setstate__(state)
    self._shards = [_UNOPENED] * len(self._read_instructions)
    self._files = [None] * len(self._read_instructions)

  def _file(self, reader_idx: int) -> CheckedFile | None:
    """The shard's checked file, opened on first use (hold `_lock`); None
    without identities."""
    if self._identities is None:
      return None
    file = self._files[reader_idx]
    if file is None:
      filename = self._read_instructions[reader_idx].filename
      try:
        file = CheckedFile(filename, self._identities.get(filename))
      except OSError as e:
        raise DataLossError(f"shard {filename} cannot be opened: {e}") from e
      self._files[reader_idx] = file
    return file

  def _check(self, reader_idx: int) -> None:
    """After a read (or its failure): refuses a shard written to since it was opened."""
    file = self._files[reader_idx]
    if file is not None:
      file.check()

  def _shard(self, reader_idx: int) -> shard_reader.ShardReader | None:
    """This shard's fast reader, opened on first use; None: use ArrayRecord."""
    shard = self._shards[reader_idx]
    if shard is _UNOPENED:
      with self._lock:
        shard = self._shards[reader_idx]
        if shard is _UNOPENED:
          filename = self._read_instructions[reader_idx].filename
          file = self._file(reader_idx)
          try:
            shard = shard_reader.open_shard(file.path if file else filename)
            if file and shard:
              file.confirm_opened()
          except (shard_reader.CorruptShard, OSError) as e:
            self._check(reader_idx)
            raise DataLossError(f"shard {filename} cannot be opened: {e}") from e
          self._shards[reader_idx] = shard
    return shard

  def _ensure_reader_exists(self, reader_idx: int) -> None:
    """ArrayRecord's reader for a shard, opened through its checked file."""
    if self._identities is None:
      super()._ensure_reader_exists(reader_idx)
      return
    if self._readers[reader_idx] is not None:
      return
    with self._lock:
      if self._readers[reader_idx] is None:
        file = self._file(reader_idx)
        reader = grain_private.array_record_reader(file.path, self._reader_options_string)
        file.confirm_opened()
        self._readers[reader_idx] = reader

  def _split(self, indices: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
    """shard -> (positions in it, places in `indices`): ArrayRecord's
    `_split_keys_per_reader` with one numpy call for the batch instead of a
    Python call per key (~1.3 µs a record)."""
    keys = np.asarray(indices, np.int64)
    if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
      raise ValueError(f"record keys must be in [0, {len(self)})")
    shards = np.searchsorted(self._key_ends, keys, "right")
    positions = keys - self._key_shift[shards]
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i, (shard, position) in enumerate(zip(shards.tolist(), positions.tolist())):
      group = out.get(shard)
      if group is None:
        group = out[shard] = ([], [])
      group[0].append(position)
      group[1].append(i)
    return out

  def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
    return self.read_raw(indices)

  def locate(self, key: int) -> tuple[str, int]:
    """(shard path, record index in it) of the source's record `key`."""
    shard = int(np.searchsorted(self._key_ends, key, "right"))
    return self._read_instructions[shard].filename, key - int(self._key_shift[shard])

  def where(self, key: int) -> str:
    """"shard F record P": where the source's record `key` is stored."""
    shard = int(np.searchsorted(self._key_ends, key, "right"))
    return (f"shard {self._read_instructions[shard].filename} record "
            f"{key - int(self._key_shift[shard])}")

  def read_raw(self, indices: Sequence[int]) -> Sequence[bytes]:
    """The records' bytes as stored (what a batch_transform is given)."""
    out: list[bytes] = [b""] * len(indices)
    for reader_idx, (positions, where) in self._split(indices).items():
      for record, i in zip(self._read(reader_idx, positions), where):
        out[i] = record
    return out

  def _read(self, reader_idx: int, positions: list[int]) -> Sequence[bytes]:
    filename = self._read_instructions[reader_idx].filename
    shard = self._shard(reader_idx)
    if shard is not None:
      try:
        records = shard.read(positions)
      except shard_reader.CorruptShard:
        self._check(reader_idx)  # rewritten in place: say so, not "corrupt"
        _raise_for_first_bad_record(filename, positions,
                                    lambda p: shard.read([p]), shard_reader.CorruptShard)
        raise
      except OSError as e:
        self._check(reader_idx)
        raise DataLossError(f"shard {filename} cannot be read: {e}") from e
      except shard_reader.UnsupportedShard as e:  # a chunk unlike the first
        self._check(reader_idx)
        log.warning("%s: %s; reading it through ArrayRecord from now on", filename, e)
        self._shards[reader_idx] = None
      else:
        # After the read: a write(2) that any of these bytes could come from
        # has already moved the mtime (the kernel sets it before copying in).
        self._check(reader_idx)
        return records
    return self._read_with_array_record(reader_idx, positions)

  def _read_with_array_record(self, reader_idx: int, positions: list[int]) -> Sequence[bytes]:
    filename = self._read_instructions[reader_idx].filename
    try:
      self._ensure_reader_exists(reader_idx)
      reader = self._readers[reader_idx]
      if self._reads_singly():
        records = [reader.read([p])[0] for p in positions]
      else:
        records = reader.read(positions)
    except (ShardChangedError, DataLossError):  # refused before any read
      raise
    except Exception as e:  # pylint: disable=broad-except
      self._check(reader_idx)
      _raise_for_first_bad_record(filename, positions,
                                  lambda p: self._readers[reader_idx].read([p]), Exception)
      raise DataLossError(f"shard {filename} cannot be read: {e}") from e
    self._check(reader_idx)
    return records

  def __getitem__(self, record_key: int) -> bytes:
    (record,) = self._getitems([record_key])
    return record
