"""ArrayRecord shards read one pread per chunk, riegeli's hashes checked.

ArrayRecord's Python reader costs ~20 µs of CPU per small record (its
binding, a thread pool per batched call, a zstd context per chunk) where the
work itself is a few µs; on the 2-core machine that cost, not the wire, was
what bounded the service (BENCHMARKS.md). This reader parses the footer that
ArrayRecord writes (one offset per chunk), then reads the chunk holding each
record in C (server/riegeli.c), which checks the header and data hashes:
`read_chunk` returns a chunk's data (one pread; the GIL is let go only for
big chunks and reads that must wait for the disk), and here its framing is
undone and zstd, if the shard uses it, decompressed, a shard-batch of small
records in one call. Big records that zstd stored as raw blocks (what it
does with incompressible bytes: images, media) or that are uncompressed are
read by `read_record` straight into the record, without that copy, in two
reads: the chunk header, then one `preadv` for the rest.

It reads what `ArrayRecordWriter` writes by default: simple chunks,
uncompressed or zstd, any group size. `open_shard` returns None for anything
else (brotli, snappy, transposed chunks, another footer layout) and when the
C part was not built (no compiler at install): those shards are read through
ArrayRecord, exactly as before.

Layout: riegeli/doc/riegeli_records_file_format.md and array_record's
cpp/layout.proto. Records are the same bytes ArrayRecord returns (tested
shard by shard against it).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

import numpy as np
import zstandard

from grain_elevator.proto import varint

try:
  from grain_elevator.server import _riegeli  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler
  _riegeli = None

log = logging.getLogger("grain_elevator.server")

BLOCK_SIZE = 1 << 16
_SIMPLE_CHUNK = ord("r")
_UNCOMPRESSED, _ZSTD = 0, ord("z")
_ARRAY_RECORD_MAGIC = 0x71930E704FDAE05E
_ARRAY_RECORD_VERSION = 1
# ELEVATOR_SHARD_READER=arrayrecord reads every shard through ArrayRecord:
# for comparing the two (elevator bench does) or ruling this reader out.
READER_ENV = "ELEVATOR_SHARD_READER"
READER_CHOICES = ("auto", "arrayrecord")
# A zstd context per thread: decompressors are not safe to share, and making
# one per chunk is part of what ArrayRecord pays.
_local = threading.local()


class UnsupportedShard(Exception):
  """A valid shard this reader does not decode; ArrayRecord reads it."""


class CorruptShard(ValueError):
  """A chunk failed its hash, its framing or a bound on its sizes; from a
  ShardReader the message names the shard and the chunk's byte offset."""


def available() -> bool:
  """Whether the C part was built (else every shard goes through ArrayRecord)."""
  return _riegeli is not None


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
    log.warning("grain_elevator.server._riegeli was not built (no C compiler when the "
                "package was installed?): every shard is read through ArrayRecord, "
                "~3x the CPU per small record. Reinstall with gcc present to fix.")


def _zstd() -> zstandard.ZstdDecompressor:
  d = getattr(_local, "zstd", None)
  if d is None:
    d = _local.zstd = zstandard.ZstdDecompressor()
  return d


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
  try:
    value, pos = varint.decode(buf, pos)
  except ValueError as e:
    raise CorruptShard(str(e)) from e
  if value >> 64:
    raise CorruptShard("a varint overflows 64 bits")
  return value, pos


def _fields(message: bytes) -> dict[int, int | bytes]:
  """The varint and length-delimited fields of a small protobuf message."""
  try:
    return {number: value if isinstance(value, int) else bytes(value)
            for number, _, value in varint.fields(message)}
  except ValueError as e:
    raise CorruptShard(f"footer message: {e}") from e


# Chunk types and compressions riegeli defines that this reader leaves to
# ArrayRecord; any other value in a record chunk is corruption.
_TRANSPOSED_CHUNK = ord("t")
_BROTLI, _SNAPPY = ord("b"), ord("s")


def _split(chunk_type: int, data: bytes) -> tuple[int, memoryview, memoryview]:
  """A simple chunk's (compression, compressed sizes, compressed values)."""
  if chunk_type != _SIMPLE_CHUNK:
    if chunk_type == _TRANSPOSED_CHUNK:
      raise UnsupportedShard("transposed chunks (only simple chunks, 'r')")
    raise CorruptShard(f"chunk type {chunk_type:#x} cannot hold records")
  view = memoryview(data)
  if not view:
    raise CorruptShard("empty chunk data")
  compression = view[0]
  if compression not in (_UNCOMPRESSED, _ZSTD):
    if compression in (_BROTLI, _SNAPPY):
      raise UnsupportedShard(f"compression {compression:#x} (only none and zstd)")
    raise CorruptShard(f"unknown compression {compression:#x}")
  sizes_len, pos = _varint(view, 1)
  if sizes_len > len(view) - pos:
    raise CorruptShard(f"the record sizes ({sizes_len} bytes) run past the chunk's data")
  return compression, view[pos:pos + sizes_len], view[pos + sizes_len:]


# What a chunk may decode to. zstd cannot turn fewer than 3 stored bytes (an
# RLE block's header and byte is 4) into more than a block of 128 KiB: a
# chunk that says more is corrupt. Below that, past a floor for small chunks
# and then 1024x its stored bytes, this reader declines (ArrayRecord then
# reads the shard): sizes come from the file, and python-zstandard allocates
# a frame's declared size whatever max_output_size says. Such chunks (zeros
# compress further) are rare.
_ZSTD_BLOCK = 128 << 10
_MAX_DECODED_FLOOR = 64 << 20
_MAX_DECODED_RATIO = 1024


def _check_decoded_size(decoded: int, stored: int) -> None:
  """Bounds what `stored` bytes of zstd data may decode to, before anything
  is allocated for it."""
  if decoded > _ZSTD_BLOCK * ((stored + 2) // 3):
    raise CorruptShard(f"{stored} bytes of zstd data cannot decode to {decoded} bytes")
  bound = max(_MAX_DECODED_FLOOR, _MAX_DECODED_RATIO * stored)
  if decoded > bound:
    raise UnsupportedShard(f"a chunk of {stored} bytes says it decodes to {decoded} bytes, "
                           f"over this reader's bound of {bound}")


def _zstd_frame(block: memoryview, expected: int | None = None,
                bound: int | None = None) -> tuple[memoryview, int]:
  """A riegeli compressed block: (its zstd frame, its decompressed size).
  The size must be `expected` (or at most `bound`), the frame must fill the
  block exactly and declare no other size: nothing is read here that
  ArrayRecord's own reader would reject, and nothing allocated unchecked."""
  size, pos = _varint(block, 0)
  if expected is not None and size != expected:
    raise CorruptShard(f"zstd block says it holds {size} bytes, the chunk header {expected}")
  frame = block[pos:]
  if bound is not None:
    bound = min(bound, _ZSTD_BLOCK * ((len(frame) + 2) // 3))
    if size > bound:
      raise CorruptShard(f"{len(frame)} bytes of zstd cannot hold the {size} bytes they say")
  length, declared = _riegeli.zstd_frame(frame)
  if length < 0:
    raise CorruptShard("zstd frame is malformed or cut short")
  if length != len(frame):
    raise CorruptShard(f"{len(frame) - length} bytes follow the zstd frame")
  if declared not in (size, -1):
    raise CorruptShard(f"zstd frame declares {declared} bytes, the block says {size}")
  return frame, size


def _checked(out: bytes, size: int) -> bytes:
  if len(out) != size:
    raise CorruptShard(f"zstd block decompressed to {len(out)} bytes, expected {size}")
  return out


def _decompress_frame(frame: memoryview, size: int) -> bytes:
  """One frame of a checked size. An empty one is decoded for real:
  python-zstandard's decompress() returns b"" for a frame that declares no
  content without reading it, where ArrayRecord would refuse what follows."""
  try:
    if size:
      return _checked(_zstd().decompress(frame, max_output_size=size), size)
    stream = _zstd().decompressobj()
    if stream.decompress(frame) or not stream.eof:
      raise CorruptShard("the zstd frame of an empty block is not empty or is cut short")
    return b""
  except zstandard.ZstdError as e:
    raise CorruptShard(f"zstd: {e}") from e


def _decompress(block: memoryview, compression: int, expected: int | None = None,
                bound: int | None = None) -> bytes | memoryview:
  if compression == _UNCOMPRESSED:
    return block
  return _decompress_frame(*_zstd_frame(block, expected, bound))


# Below this size, frames are decompressed together: python-zstandard releases
# the GIL for every call, and on a busy worker each release hands it to
# another thread and costs more than decompressing a small record.
_BATCH_DECOMPRESS_BYTES = 64 << 10


def _decompress_frames(frames: list[memoryview], sizes: list[int]) -> list[bytes]:
  """Frames of checked sizes, none empty: multi_decompress_to_buffer frees a
  buffer twice when one is (python-zstandard 0.25; a heap corruption on a
  valid shard of empty records)."""
  if len(frames) > 1 and max(sizes) < _BATCH_DECOMPRESS_BYTES:
    many = getattr(_zstd(), "multi_decompress_to_buffer", None)  # not in the cffi backend
    if many is not None:
      try:
        out = many(frames, decompressed_sizes=np.asarray(sizes, np.uint64).tobytes())
      except zstandard.ZstdError as e:
        raise CorruptShard(f"zstd: {e}") from e
      return [_checked(out[k].tobytes(), size) for k, size in enumerate(sizes)]
  return [_decompress_frame(f, s) for f, s in zip(frames, sizes)]


def _check_one_size(sizes: memoryview, compression: int, decoded: int) -> None:
  """A one-record chunk's sizes part must be its one size: riegeli checks it
  (ArrayRecord refuses the chunk otherwise) though the record needs none."""
  try:
    size = _riegeli.one_size(sizes, compression)
    if size is None:  # a frame of another shape: decompress its few bytes
      raw = _decompress(sizes, compression, bound=10)
      size = int(np.frombuffer(_riegeli.varints(raw, 1), np.uint64)[0])
  except ValueError as e:  # CorruptShard included
    raise CorruptShard(f"record sizes: {e}") from e
  if size != decoded:
    raise CorruptShard(f"the record's size says {size} bytes, the chunk header {decoded}")


def _simple_chunk(chunk_type: int, num_records: int, decoded_size: int, data: bytes,
                  expected_records: int | None = None
                  ) -> tuple[np.ndarray | None, bytes | memoryview]:
  """(record sizes, or None for a one-record chunk; the concatenated records).
  `expected_records`: the footer's count for this chunk, which the header's
  must equal."""
  if expected_records is not None and num_records != expected_records:
    raise CorruptShard(f"the chunk header says {num_records} records, the footer "
                       f"{expected_records}")
  compression, sizes_raw, values_raw = _split(chunk_type, data)
  if compression == _ZSTD:
    _check_decoded_size(decoded_size, len(values_raw))
  values = _decompress(values_raw, compression, expected=decoded_size)
  if len(values) != decoded_size:
    raise CorruptShard(f"records total {len(values)} bytes, the header says {decoded_size}")
  if num_records == 1:  # its size is the chunk's decoded size
    _check_one_size(sizes_raw, compression, decoded_size)
    return None, values
  if num_records > len(sizes_raw) * (1 if compression == _UNCOMPRESSED else _ZSTD_BLOCK):
    raise CorruptShard(f"{len(sizes_raw)} bytes cannot hold {num_records} record sizes")
  try:
    sizes = np.frombuffer(_riegeli.varints(_decompress(sizes_raw, compression,
                                                       bound=10 * num_records),
                                           num_records, decoded_size), np.uint64)
  except ValueError as e:  # a count, a varint or a total that does not fit
    raise CorruptShard(f"record sizes: {e}") from e
  return sizes, values


def _starts(counts: np.ndarray) -> np.ndarray:
  """[0, c0, c0+c1, ...] as int64 (uint64 mixed with a Python int makes floats)."""
  out = np.zeros(len(counts) + 1, np.int64)
  np.cumsum(counts, dtype=np.int64, out=out[1:])
  return out


class ShardReader:
  """Random access to one ArrayRecord shard; safe to share between threads."""

  def __init__(self, path: str):
    if _riegeli is None:
      raise UnsupportedShard("grain_elevator.server._riegeli was not built")
    self.path = path
    self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
      self._open()
    except BaseException:
      os.close(self._fd)
      raise

  def _corrupt(self, begin: int, what: str | BaseException) -> CorruptShard:
    """`what` went wrong in the chunk at `begin`: the error, naming both."""
    what = str(what)
    if not what.startswith("chunk at byte "):  # the C part's errors name it already
      what = f"chunk at byte {begin}: {what}"
    return CorruptShard(f"{self.path}: {what}")

  def _open(self) -> None:
    size = os.fstat(self._fd).st_size
    if size < BLOCK_SIZE:
      raise CorruptShard(f"{self.path}: {size} bytes is less than ArrayRecord's 64 KiB "
                         "postscript block")
    postscript_at = size - BLOCK_SIZE
    postscript = self._records(postscript_at, size)
    try:
      fields = _fields(bytes(postscript[0])) if postscript else {}
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
    if sizes is None or len(sizes) < 1:
      raise UnsupportedShard("the footer holds no metadata record")
    meta = _fields(bytes(values[:int(sizes[0])]))
    array_record = meta.get(1)
    if not isinstance(array_record, bytes):
      raise UnsupportedShard("footer metadata is not ArrayRecordMetadata")
    info = _fields(array_record)
    if info.get(1) != _ARRAY_RECORD_VERSION:
      raise UnsupportedShard(f"ArrayRecord layout version {info.get(1)}")
    entries = memoryview(values)[int(sizes[0]):]
    entry_sizes = sizes[1:].tobytes()
    try:
      offsets, decoded, counts = (
          np.frombuffer(_riegeli.message_field(entries, entry_sizes, field), np.uint64)
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
    self._first_record = _starts(counts)
    self._one_per_chunk = bool(len(counts) == 0 or (counts == 1).all())
    self.num_records = int(self._first_record[-1])

  def _read_chunk(self, begin: int, end: int) -> tuple[int, int, int, bytes]:
    try:
      return _riegeli.read_chunk(self._fd, begin, end)
    except ValueError as e:
      raise self._corrupt(begin, e) from e

  def _read_record(self, begin: int, end: int) -> bytes | None:
    try:
      return _riegeli.read_record(self._fd, begin, end)
    except ValueError as e:
      raise self._corrupt(begin, e) from e

  def _chunk(self, begin: int, end: int, expected_records: int | None = None
             ) -> tuple[np.ndarray | None, bytes | memoryview]:
    chunk = self._read_chunk(begin, end)
    try:
      return _simple_chunk(*chunk, expected_records)
    except CorruptShard as e:
      raise self._corrupt(begin, e) from e

  def _records(self, begin: int, end: int, expected_records: int | None = None
               ) -> list[bytes | memoryview]:
    sizes, values = self._chunk(begin, end, expected_records)
    if sizes is None:
      return [values]
    bounds = _starts(sizes).tolist()
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]

  def read(self, indices: Sequence[int]) -> list[bytes]:
    """The records at `indices` (positions in this shard), as bytes."""
    if len(indices) and (min(indices) < 0 or max(indices) >= self.num_records):
      bad = next(i for i in indices if not 0 <= i < self.num_records)
      raise IndexError(f"record {bad} of {self.num_records}")
    if self._one_per_chunk:
      return self._read_single_record_chunks(indices)
    chunks = np.searchsorted(self._first_record, np.asarray(indices, np.int64), "right") - 1
    decoded: dict[int, list[bytes | memoryview]] = {}
    out: list[bytes] = []
    for i, c in zip(indices, chunks.tolist()):
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
    small = _riegeli.SMALL_EXTENT
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
        compression, sizes_raw, values = _split(chunk_type, data)
        if compression == _UNCOMPRESSED:
          if len(values) != decoded:
            raise CorruptShard(f"record is {len(values)} bytes, the header says {decoded}")
          record = bytes(values)
        else:
          _check_decoded_size(decoded, len(values))
          frame, _ = _zstd_frame(values, decoded)
          record = None
        _check_one_size(sizes_raw, compression, decoded)
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
          out[k] = _decompress_frame(frame, 0)
        except CorruptShard as e:
          raise self._corrupt(begin, e) from e
    if frames:
      try:
        records = _decompress_frames(frames, sizes)
      except CorruptShard:  # rare: find the chunk to name
        for k, frame, size in zip(where, frames, sizes):
          try:
            _decompress_frame(frame, size)
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
