"""Where a shard is read: ArrayRecord shards, one pread per chunk.

ArrayRecord's Python reader costs ~20 µs of CPU per small record (its
binding, a thread pool per batched call, a zstd context per chunk) where the
work itself is a few µs (`elevator bench`'s "arrayrecord reader" row,
BENCHMARKS.md). This reader parses the footer ArrayRecord writes (one
offset per chunk, checked whole at open), then reads the chunk holding each
record in C (riegeli.c: one pread, header and data hashes checked; the GIL
let go only for big chunks and reads that must wait for the disk) and
decodes it (chunks.py), a shard-batch of small records in one call. Big
records that zstd stored as raw blocks (incompressible bytes: images,
media) or that are uncompressed are read by `read_record` straight into the
record in two reads: the chunk header, then one `preadv` for the rest.

It reads what `ArrayRecordWriter` writes by default: simple chunks,
uncompressed or zstd, any group size. `open_shard` returns None for anything
else (brotli, snappy, transposed chunks, another footer layout) and when the
C part was not built (no compiler at install): those shards are read through
ArrayRecord. Layout: array_record's cpp/layout.proto. Records are the same
bytes ArrayRecord returns (tested shard by shard against it).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np

from grain_elevator.server.data.shards import chunks
from grain_elevator.server.data.shards.chunks import (BLOCK_SIZE, CorruptShard,
                                                      UnsupportedShard, available)

log = logging.getLogger("grain_elevator.server")

_ARRAY_RECORD_MAGIC = 0x71930E704FDAE05E
_ARRAY_RECORD_VERSION = 1
# ELEVATOR_SHARD_READER=arrayrecord reads every shard through ArrayRecord:
# for comparing the two (elevator bench does) or ruling this reader out.
READER_ENV = "ELEVATOR_SHARD_READER"
READER_CHOICES = ("auto", "arrayrecord")


def reader_choice() -> str:
  """The operator's choice of reader; raises ValueError naming the variable."""
  choice = os.environ.get(READER_ENV, "") or "auto"
  if choice not in READER_CHOICES:
    raise ValueError(f"{READER_ENV}={choice!r}: expected one of {', '.join(READER_CHOICES)}")
  return choice


_warned = False


def check_setup() -> None:
  """At start-up: refuses a bad READER_ENV; says once when the C part is missing."""
  global _warned
  if reader_choice() == "auto" and not available() and not _warned:
    _warned = True
    log.warning("grain_elevator.server.data.shards._riegeli was not built (no C compiler when the "
                "package was installed?): every shard is read through ArrayRecord, "
                "~3x the CPU per small record. Reinstall with gcc present to fix.")


class ShardReader:
  """Random access to one ArrayRecord shard; safe to share between threads."""

  def __init__(self, path: str):
    if chunks.riegeli is None:
      raise UnsupportedShard("grain_elevator.server.data.shards._riegeli was not built")
    self.path = path
    self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
      self._open(os.fstat(self._fd).st_size)
    except BaseException:
      os.close(self._fd)
      raise

  def _corrupt(self, begin: int, what: str | BaseException) -> CorruptShard:
    """`what` went wrong in the chunk at `begin`: the error, naming both."""
    what = str(what)
    if not what.startswith("chunk at byte "):  # the C part's errors name it already
      what = f"chunk at byte {begin}: {what}"
    return CorruptShard(f"{self.path}: {what}")

  def _open(self, size: int) -> None:
    if size < BLOCK_SIZE:
      raise CorruptShard(f"{self.path}: {size} bytes is less than ArrayRecord's 64 KiB "
                         "postscript block")
    postscript_at = size - BLOCK_SIZE
    postscript = self._records(postscript_at, size)
    try:
      fields = chunks.message_fields(bytes(postscript[0])) if postscript else {}
    except CorruptShard as e:
      raise self._corrupt(postscript_at, e) from e
    if fields.get(2) != _ARRAY_RECORD_MAGIC or not isinstance(fields.get(1), int):
      raise UnsupportedShard("no ArrayRecord postscript in the last 64 KiB block")
    footer_at = fields[1]
    try:
      self._read_footer(footer_at, postscript_at)
    except CorruptShard as e:
      raise self._corrupt(footer_at, e) from e
    if len(self._begins):  # the writer's options hold for every chunk: probe one
      self._chunk(int(self._begins[0]), int(self._ends[0]), int(self._counts[0]))

  def _read_footer(self, footer_at: int, postscript_at: int) -> None:
    """ArrayRecord's index: where each chunk starts, how many records and
    bytes it holds. Checked whole here, so that reads can trust it: chunks
    in order before the footer, and the records spread as ArrayRecord's own
    reader assumes (it finds record i in chunk i // the first chunk's count)."""
    sizes, values = self._chunk(footer_at, postscript_at)
    if sizes is None:  # one record: the metadata of a shard with no chunks (an empty one)
      sizes = np.asarray([len(values)], np.uint64)
    if len(sizes) < 1:
      raise UnsupportedShard("the footer holds no metadata record")
    meta = chunks.message_fields(bytes(values[:int(sizes[0])]))
    array_record = meta.get(1)
    if not isinstance(array_record, bytes):
      raise UnsupportedShard("footer metadata is not ArrayRecordMetadata")
    info = chunks.message_fields(array_record)
    if info.get(1) != _ARRAY_RECORD_VERSION:
      raise UnsupportedShard(f"ArrayRecord layout version {info.get(1)}")
    entries = memoryview(values)[int(sizes[0]):]
    entry_sizes = sizes[1:].tobytes()
    try:
      offsets, decoded, counts = (
          np.frombuffer(chunks.riegeli.message_field(entries, entry_sizes, field), np.uint64)
          for field in (1, 2, 3))
    except ValueError as e:
      raise CorruptShard(str(e)) from e
    if len(offsets) != info.get(2, 0):
      raise CorruptShard(f"the footer lists {len(offsets)} chunks, its metadata {info.get(2, 0)}")
    ends = np.append(offsets[1:], np.uint64(footer_at))
    if len(offsets) and (np.any(offsets[1:] <= offsets[:-1]) or int(offsets[-1]) >= footer_at):
      raise CorruptShard("the footer's chunk offsets are not increasing")
    # A chunk cannot hold more records than bytes (riegeli pads it): with
    # that, no sum below overflows.
    if len(counts) and (int(counts[0]) < 1 or np.any(counts[:-1] != counts[0])
                        or not 1 <= int(counts[-1]) <= int(counts[0])
                        or np.any(counts > ends - offsets)):
      raise CorruptShard("the footer's record counts are not ArrayRecord's layout "
                         "(every chunk but the last holding the first one's count)")
    if int(counts.sum()) != info.get(3, 0):
      raise CorruptShard(f"the footer's chunks hold {int(counts.sum())} records, its "
                         f"metadata says {info.get(3, 0)}")
    self._begins = offsets
    self._ends = ends
    self._counts = counts
    self._decoded = decoded
    self._first_record = chunks.starts(counts)
    self._one_per_chunk = bool(len(counts) == 0 or (counts == 1).all())
    self.num_records = int(self._first_record[-1])

  def _read_chunk(self, begin: int, end: int) -> tuple[int, int, int, bytes]:
    try:
      return chunks.riegeli.read_chunk(self._fd, begin, end)
    except ValueError as e:
      raise self._corrupt(begin, e) from e

  def _read_record(self, begin: int, end: int) -> bytes | None:
    try:
      return chunks.riegeli.read_record(self._fd, begin, end)
    except ValueError as e:
      raise self._corrupt(begin, e) from e

  def _chunk(self, begin: int, end: int, expected_records: int | None = None
             ) -> tuple[np.ndarray | None, bytes | memoryview]:
    chunk = self._read_chunk(begin, end)
    try:
      return chunks.simple_chunk(*chunk, expected_records)
    except CorruptShard as e:
      raise self._corrupt(begin, e) from e

  def _records(self, begin: int, end: int, expected_records: int | None = None
               ) -> list[bytes | memoryview]:
    sizes, values = self._chunk(begin, end, expected_records)
    if sizes is None:
      return [values]
    bounds = chunks.starts(sizes).tolist()
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]

  def _check_indices(self, indices: Sequence[int]) -> None:
    if len(indices) and (min(indices) < 0 or max(indices) >= self.num_records):
      bad = next(i for i in indices if not 0 <= i < self.num_records)
      raise IndexError(f"record {bad} of {self.num_records}")

  def chunks_of(self, indices: Sequence[int]) -> np.ndarray:
    """The chunk holding each record (positions in this shard)."""
    if self._one_per_chunk:
      return np.asarray(indices, np.int64)
    return np.searchsorted(self._first_record, np.asarray(indices, np.int64), "right") - 1

  def extent(self, chunk: int) -> tuple[int, int]:
    """Where chunk `chunk` lies in the shard: [begin, end)."""
    return int(self._begins[chunk]), int(self._ends[chunk])

  def read(self, indices: Sequence[int]) -> list[bytes]:
    """The records at `indices` (positions in this shard), as bytes."""
    self._check_indices(indices)
    if self._one_per_chunk:
      return self._read_single_record_chunks(indices)
    in_chunk = self.chunks_of(indices)
    decoded: dict[int, list[bytes | memoryview]] = {}
    out: list[bytes] = []
    for i, c in zip(indices, in_chunk.tolist()):
      records = decoded.get(c)
      if records is None:
        begin = int(self._begins[c])
        records = decoded[c] = self._records(begin, int(self._ends[c]), int(self._counts[c]))
        self._check_footer_size(begin, int(self._decoded[c]),
                                sum(len(r) for r in records))
      record = records[i - int(self._first_record[c])]
      out.append(record if type(record) is bytes else bytes(record))
    return out

  def _check_footer_size(self, begin: int, footer: int, decoded: int) -> None:
    """The footer's copy of a chunk's decoded size (0: not written) must agree."""
    if footer and footer != decoded:
      raise self._corrupt(begin, f"the chunk decodes to {decoded} bytes, the footer says {footer}")

  def _read_single_record_chunks(self, indices: Sequence[int]) -> list[bytes]:
    """ArrayRecord's default layout (group_size:1): the chunk is the record."""
    out: list[bytes] = [b""] * len(indices)
    frames: list[memoryview] = []
    sizes: list[int] = []
    where: list[int] = []
    at = np.asarray(indices, np.int64)
    small = chunks.riegeli.SMALL_EXTENT
    begins = self._begins[at].tolist()
    footer_sizes = self._decoded[at].tolist()
    for k, (begin, end) in enumerate(zip(begins, self._ends[at].tolist())):
      if end - begin > small:
        # Big records: straight into place, without a decompression copy, when
        # zstd stored them as raw blocks (incompressible: images, media).
        record = self._read_record(begin, end)
        if record is not None:
          self._check_footer_size(begin, footer_sizes[k], len(record))
          out[k] = record
          continue
      chunk_type, num_records, decoded, data = self._read_chunk(begin, end)
      try:
        if num_records != 1:
          raise CorruptShard(f"the chunk header says {num_records} records, the footer 1")
        compression, sizes_raw, values = chunks.split(chunk_type, data)
        if compression == chunks.UNCOMPRESSED:
          if len(values) != decoded:
            raise CorruptShard(f"record is {len(values)} bytes, the header says {decoded}")
          record = bytes(values)
        else:
          chunks.check_decoded_size(decoded, len(values))
          frame, _ = chunks.zstd_frame(values, decoded)
          record = None
        chunks.check_one_size(sizes_raw, compression, decoded)
      except CorruptShard as e:
        raise self._corrupt(begin, e) from e
      self._check_footer_size(begin, footer_sizes[k], decoded)
      if record is not None:
        out[k] = record
      elif decoded:
        frames.append(frame)
        sizes.append(decoded)
        where.append(k)
      else:
        try:
          out[k] = chunks.decompress_frame(frame, 0)
        except CorruptShard as e:
          raise self._corrupt(begin, e) from e
    if frames:
      try:
        records = chunks.decompress_frames(frames, sizes)
      except CorruptShard:  # rare: find the chunk to name
        for k, frame, size in zip(where, frames, sizes):
          try:
            chunks.decompress_frame(frame, size)
          except CorruptShard as e:
            raise self._corrupt(begins[k], e) from e
        raise
      for k, record in zip(where, records):
        out[k] = record
    return out

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


def open_shard(path: str) -> ShardReader | None:
  """A reader for `path`, or None where ArrayRecord must read it.

  Corruption found while opening (a bad postscript or footer hash) is raised,
  not hidden behind the fallback.
  """
  if reader_choice() == "arrayrecord":
    return None
  try:
    return ShardReader(path)
  except UnsupportedShard as e:
    if available():
      log.info("%s: read through ArrayRecord (%s)", path, e)
    return None
