"""ArrayRecord's chunks: riegeli's simple chunk format, decoded and checked.

A chunk read from a shard (the C part, riegeli.c, checks its header and data
hashes as it reads: one pread) is undone here: its framing, the record
sizes and values, zstd if the shard uses it, a shard-batch of small records
in one call. Every size comes from the file and is bounded before anything
is allocated for it (`check_decoded_size`). What this module does not decode
(brotli, snappy, transposed chunks) is `UnsupportedShard`: ArrayRecord reads
those shards. Layout: riegeli/doc/riegeli_records_file_format.md.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from grain_elevator.proto import varint

try:  # riegeli.c, built at install
  from grain_elevator.server.data.shards import _riegeli as riegeli  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler
  riegeli = None

BLOCK_SIZE = 1 << 16
_SIMPLE_CHUNK = ord("r")
UNCOMPRESSED, ZSTD = 0, ord("z")
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
  return riegeli is not None


def _zstd() -> zstandard.ZstdDecompressor:
  d = getattr(_local, "zstd", None)
  if d is None:
    d = _local.zstd = zstandard.ZstdDecompressor()
  return d


def varint_at(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
  try:
    return varint.decode(buf, pos)
  except ValueError as e:
    raise CorruptShard(str(e)) from e


def message_fields(message: bytes) -> dict[int, int | bytes]:
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


def split(chunk_type: int, data: bytes) -> tuple[int, memoryview, memoryview]:
  """A simple chunk's (compression, compressed sizes, compressed values)."""
  if chunk_type != _SIMPLE_CHUNK:
    if chunk_type == _TRANSPOSED_CHUNK:
      raise UnsupportedShard("transposed chunks (only simple chunks, 'r')")
    raise CorruptShard(f"chunk type {chunk_type:#x} cannot hold records")
  view = memoryview(data)
  if not view:
    raise CorruptShard("empty chunk data")
  compression = view[0]
  if compression not in (UNCOMPRESSED, ZSTD):
    if compression in (_BROTLI, _SNAPPY):
      raise UnsupportedShard(f"compression {compression:#x} (only none and zstd)")
    raise CorruptShard(f"unknown compression {compression:#x}")
  sizes_len, pos = varint_at(view, 1)
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


def check_decoded_size(decoded: int, stored: int) -> None:
  """Bounds what `stored` bytes of zstd data may decode to, before anything
  is allocated for it."""
  if decoded > _ZSTD_BLOCK * ((stored + 2) // 3):
    raise CorruptShard(f"{stored} bytes of zstd data cannot decode to {decoded} bytes")
  bound = max(_MAX_DECODED_FLOOR, _MAX_DECODED_RATIO * stored)
  if decoded > bound:
    raise UnsupportedShard(f"a chunk of {stored} bytes says it decodes to {decoded} bytes, "
                           f"over this reader's bound of {bound}")


def zstd_frame(block: memoryview, expected: int | None = None,
                bound: int | None = None) -> tuple[memoryview, int]:
  """A riegeli compressed block: (its zstd frame, its decompressed size).
  The size must be `expected` (or at most `bound`), the frame must fill the
  block exactly and declare no other size: nothing is read here that
  ArrayRecord's own reader would reject, and nothing allocated unchecked."""
  size, pos = varint_at(block, 0)
  if expected is not None and size != expected:
    raise CorruptShard(f"zstd block says it holds {size} bytes, the chunk header {expected}")
  frame = block[pos:]
  if bound is not None:
    bound = min(bound, _ZSTD_BLOCK * ((len(frame) + 2) // 3))
    if size > bound:
      raise CorruptShard(f"{len(frame)} bytes of zstd cannot hold the {size} bytes they say")
  length, declared = riegeli.zstd_frame(frame)
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


def decompress_frame(frame: memoryview, size: int) -> bytes:
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


def decompress(block: memoryview, compression: int, expected: int | None = None,
                bound: int | None = None) -> bytes | memoryview:
  if compression == UNCOMPRESSED:
    return block
  return decompress_frame(*zstd_frame(block, expected, bound))


# Below this size, frames are decompressed together: python-zstandard releases
# the GIL for every call, and on a busy worker each release hands it to
# another thread and costs more than decompressing a small record.
_BATCH_DECOMPRESS_BYTES = 64 << 10


def decompress_frames(frames: list[memoryview], sizes: list[int]) -> list[bytes]:
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
  return [decompress_frame(f, s) for f, s in zip(frames, sizes)]


def check_one_size(sizes: memoryview, compression: int, decoded: int) -> None:
  """A one-record chunk's sizes part must be its one size: riegeli checks it
  (ArrayRecord refuses the chunk otherwise) though the record needs none."""
  try:
    size = riegeli.one_size(sizes, compression)
    if size is None:  # a frame of another shape: decompress its few bytes
      raw = decompress(sizes, compression, bound=10)
      size = int(np.frombuffer(riegeli.varints(raw, 1), np.uint64)[0])
  except ValueError as e:  # CorruptShard included
    raise CorruptShard(f"record sizes: {e}") from e
  if size != decoded:
    raise CorruptShard(f"the record's size says {size} bytes, the chunk header {decoded}")


def simple_chunk(chunk_type: int, num_records: int, decoded_size: int, data: bytes,
                  expected_records: int | None = None
                  ) -> tuple[np.ndarray | None, bytes | memoryview]:
  """(record sizes, or None for a one-record chunk; the concatenated records).
  `expected_records`: the footer's count for this chunk, which the header's
  must equal."""
  if expected_records is not None and num_records != expected_records:
    raise CorruptShard(f"the chunk header says {num_records} records, the footer "
                       f"{expected_records}")
  compression, sizes_raw, values_raw = split(chunk_type, data)
  if compression == ZSTD:
    check_decoded_size(decoded_size, len(values_raw))
  values = decompress(values_raw, compression, expected=decoded_size)
  if len(values) != decoded_size:
    raise CorruptShard(f"records total {len(values)} bytes, the header says {decoded_size}")
  if num_records == 1:  # its size is the chunk's decoded size
    check_one_size(sizes_raw, compression, decoded_size)
    return None, values
  if num_records > len(sizes_raw) * (1 if compression == UNCOMPRESSED else _ZSTD_BLOCK):
    raise CorruptShard(f"{len(sizes_raw)} bytes cannot hold {num_records} record sizes")
  try:
    sizes = np.frombuffer(riegeli.varints(decompress(sizes_raw, compression,
                                                       bound=10 * num_records),
                                           num_records, decoded_size), np.uint64)
  except ValueError as e:  # a count, a varint or a total that does not fit
    raise CorruptShard(f"record sizes: {e}") from e
  return sizes, values


def starts(counts: np.ndarray) -> np.ndarray:
  """[0, c0, c0+c1, ...] as int64 (uint64 mixed with a Python int makes floats)."""
  out = np.zeros(len(counts) + 1, np.int64)
  np.cumsum(counts, dtype=np.int64, out=out[1:])
  return out


