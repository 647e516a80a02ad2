"""Riegeli/ArrayRecord layout for the fuzzer: take a shard apart into chunks
and lay chunks out again as a valid file (block headers, padding, footer,
postscript), so that a mutant can say anything while every hash checks.

Written from riegeli's records file format description and what
ArrayRecordWriter is seen to write, independently of server/data/shards/riegeli.c: a
shared misreading would hide the bugs the fuzzer is for. Only the hash is
borrowed from the extension (HighwayHash with riegeli's key; the unit tests
check it against hashes riegeli wrote).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import zstandard

BLOCK = 1 << 16
BLOCK_HEADER = 24
USABLE = BLOCK - BLOCK_HEADER
CHUNK_HEADER = 40
SIMPLE, PADDING, SIGNATURE = ord("r"), ord("p"), ord("s")
NONE, ZSTD = 0, ord("z")
MAGIC = 0x71930E704FDAE05E
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

Hash = Callable[[bytes], int]


def le64(b: bytes) -> int:
  return int.from_bytes(b, "little")


def u64(v: int) -> bytes:
  return (v % (1 << 64)).to_bytes(8, "little")


# Positions: a chunk's bytes are "logical"; the file interleaves a block
# header every 64 KiB ("physical").

def add_with_overhead(begin: int, length: int) -> int:
  """The physical position `length` logical bytes after chunk start `begin`."""
  blocks = (length + (begin + USABLE - 1) % BLOCK) // USABLE
  return begin + length + blocks * BLOCK_HEADER


def round_up_to_chunk_boundary(pos: int) -> int:
  """Chunks never start inside a block header or right after one."""
  remaining = -pos % BLOCK
  return pos + max(0, remaining - (USABLE - 1))


def chunk_end(begin: int, data_size: int, num_records: int) -> int:
  """Where riegeli says the chunk at `begin` ends (with its padding)."""
  return max(add_with_overhead(begin, CHUNK_HEADER + data_size),
             round_up_to_chunk_boundary(begin + num_records))


def physical(begin: int, n: int) -> list[int]:
  """The file offsets of `n` logical bytes of the chunk that starts at `begin`."""
  out: list[int] = []
  pos = begin
  while len(out) < n:
    if pos % BLOCK < BLOCK_HEADER:
      pos += BLOCK_HEADER - pos % BLOCK
    step = min(n - len(out), BLOCK - pos % BLOCK)
    out.extend(range(pos, pos + step))
    pos += step
  return out


@dataclasses.dataclass
class Chunk:
  """One chunk as its header describes it; `data` is its logical data."""
  chunk_type: int
  num_records: int
  decoded_size: int
  data: bytes
  begin: int = -1  # where it was (parse) or was put (lay_out)


def parse(file: bytes) -> list[Chunk]:
  """The chunks of a valid riegeli file, in order (signature to last padding)."""
  chunks: list[Chunk] = []
  pos = 0
  while pos < len(file):
    head = bytes(file[i] for i in physical(pos, CHUNK_HEADER))
    data_size = le64(head[8:16])
    type_and_count = le64(head[24:32])
    data = bytes(file[i] for i in physical(pos, CHUNK_HEADER + data_size)[CHUNK_HEADER:])
    chunk = Chunk(type_and_count & 0xFF, type_and_count >> 8, le64(head[32:40]), data, pos)
    chunks.append(chunk)
    pos = chunk_end(pos, data_size, chunk.num_records)
  return chunks


def header_bytes(hash_fn: Hash, chunk: Chunk, data_size: int | None = None) -> bytes:
  """A chunk header, hashes computed (`data_size` overrides len(data) without
  changing the data hash, for headers that lie)."""
  body = (u64(len(chunk.data) if data_size is None else data_size) + u64(hash_fn(chunk.data)) +
          u64(chunk.chunk_type | (chunk.num_records << 8)) + u64(chunk.decoded_size))
  return u64(hash_fn(body)) + body


def _place(out: bytearray, hash_fn: Hash, begin: int, end: int, logical: bytes) -> None:
  """Writes a chunk's logical bytes from `begin` and the block headers of
  every block boundary it covers, up to `end` (zeros after the data)."""
  if len(out) < end:
    out.extend(bytes(end - len(out)))
  for i, b in zip(physical(begin, len(logical)), logical):
    out[i] = b
  boundary = begin if begin % BLOCK == 0 else begin + (-begin % BLOCK)
  while boundary < end:
    body = u64(boundary - begin) + u64(end - boundary)
    out[boundary:boundary + BLOCK_HEADER] = u64(hash_fn(body)) + body
    boundary += BLOCK


def padding_to(begin: int, end: int) -> Chunk | None:
  """A padding chunk from `begin` that ends exactly at `end`, if one fits."""
  if end <= begin:
    return None
  lo, hi = 0, end - begin
  while lo < hi:  # the largest data size whose chunk still ends by `end`
    mid = (lo + hi + 1) // 2
    if add_with_overhead(begin, CHUNK_HEADER + mid) <= end:
      lo = mid
    else:
      hi = mid - 1
  if add_with_overhead(begin, CHUNK_HEADER + lo) != end:
    return None
  return Chunk(PADDING, 0, 0, bytes(lo))


# A header may claim more records than a file could pad for (2**56 - 1):
# past this much padding the layout leaves it out (the file then disagrees
# with its header, as a crafted one would).
MAX_PADDING = 1 << 20


def _end(chunk: Chunk) -> int:
  end = chunk_end(chunk.begin, len(chunk.data), chunk.num_records)
  plain = add_with_overhead(chunk.begin, CHUNK_HEADER + len(chunk.data))
  return end if end - plain <= MAX_PADDING else plain


def plan(chunks: list[Chunk], pos: int = 0) -> int:
  """Puts each chunk at the next possible boundary from `pos`; returns the end."""
  for chunk in chunks:
    chunk.begin = round_up_to_chunk_boundary(pos)
    pos = _end(chunk)
  return pos


def lay_out(hash_fn: Hash, chunks: list[Chunk]) -> bytearray:
  """A file of `chunks` back to back, each at the next possible boundary."""
  plan(chunks)
  out = bytearray()
  for chunk in chunks:
    end = _end(chunk)
    _place(out, hash_fn, chunk.begin, end, header_bytes(hash_fn, chunk) + chunk.data)
  return out


# ---------------------------------------------------------------------------
# Protobuf bits: the footer and postscript are tiny messages of varints.

def varint(v: int) -> bytes:
  v %= 1 << 64
  out = bytearray()
  while True:
    if v < 0x80:
      out.append(v)
      return bytes(out)
    out.append(0x80 | (v & 0x7F))
    v >>= 7


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  v = shift = 0
  while True:
    b = buf[pos]
    pos += 1
    v |= (b & 0x7F) << shift
    if b < 0x80:
      return v, pos
    shift += 7


def message(fields: list[tuple[int, int | bytes]]) -> bytes:
  out = bytearray()
  for number, value in fields:
    if isinstance(value, int):
      out += varint(number << 3) + varint(value)
    else:
      out += varint(number << 3 | 2) + varint(len(value)) + value
  return bytes(out)


def fields_of(buf: bytes) -> list[tuple[int, int | bytes]]:
  out: list[tuple[int, int | bytes]] = []
  pos = 0
  while pos < len(buf):
    key, pos = read_varint(buf, pos)
    if key & 7 == 0:
      value, pos = read_varint(buf, pos)
      out.append((key >> 3, value))
    elif key & 7 == 2:
      n, pos = read_varint(buf, pos)
      out.append((key >> 3, buf[pos:pos + n]))
      pos += n
    else:
      raise ValueError(f"wire type {key & 7}")
  return out


# ---------------------------------------------------------------------------
# Simple chunks: compression byte, varint size of sizes, sizes, values; with
# zstd each part is varint(decompressed size) + one frame.

def compress(compression: int, raw: bytes, level: int = 3) -> bytes:
  if compression == NONE:
    return raw
  return varint(len(raw)) + zstandard.ZstdCompressor(level=level).compress(raw)


def decompress(compression: int, part: bytes) -> bytes:
  if compression == NONE:
    return part
  size, pos = read_varint(part, 0)
  if size > 64 << 20:
    raise ValueError(f"a part says it holds {size} bytes")
  return zstandard.ZstdDecompressor().decompress(part[pos:], max_output_size=max(size, 1))


def split_simple(data: bytes) -> tuple[int, bytes, bytes]:
  """(compression, sizes part, values part) of a simple chunk's data."""
  n, pos = read_varint(data, 1)
  return data[0], data[pos:pos + n], data[pos + n:]


def join_simple(compression: int, sizes_part: bytes, values_part: bytes) -> bytes:
  return bytes([compression]) + varint(len(sizes_part)) + sizes_part + values_part


def encode_records(records: list[bytes], compression: int, level: int = 3) -> Chunk:
  sizes = b"".join(varint(len(r)) for r in records)
  values = b"".join(records)
  data = join_simple(compression, compress(compression, sizes, level),
                     compress(compression, values, level))
  return Chunk(SIMPLE, len(records), len(values), data)


def decode_records(chunk: Chunk) -> list[bytes]:
  compression, sizes_part, values_part = split_simple(chunk.data)
  sizes_raw = decompress(compression, sizes_part)
  values = decompress(compression, values_part)
  out, pos, at = [], 0, 0
  while pos < len(sizes_raw):
    n, pos = read_varint(sizes_raw, pos)
    out.append(values[at:at + n])
    at += n
  return out


@dataclasses.dataclass
class Shard:
  """A parsed ArrayRecord shard: its record chunks, footer and the rest."""
  chunks: list[Chunk]        # every chunk, in file order
  records: list[int]         # indices into `chunks` of the record chunks
  footer: int                # index of the footer chunk
  postscript: int            # index of the postscript chunk


def parse_shard(file: bytes) -> Shard:
  chunks = parse(file)
  postscript = next(i for i, c in enumerate(chunks) if c.begin == len(file) - BLOCK)
  footer_offset = dict(fields_of(decode_records(chunks[postscript])[0]))[1]
  footer = next(i for i, c in enumerate(chunks) if c.begin == footer_offset)
  entries = decode_records(chunks[footer])[1:]
  offsets = [dict(fields_of(e))[1] for e in entries]
  by_begin = {c.begin: i for i, c in enumerate(chunks)}
  return Shard(chunks, [by_begin[o] for o in offsets], footer, postscript)


def honest_metadata(metadata: bytes, records: list[Chunk]) -> bytes:
  """The footer's metadata message with the chunk and record counts of `records`."""
  out: list[tuple[int, int | bytes]] = []
  for number, value in fields_of(metadata):
    if number == 1 and isinstance(value, bytes):
      inner = [(n, len(records) if n == 2 else sum(c.num_records for c in records) if n == 3
                else v) for n, v in fields_of(value)]
      value = message(inner)
    out.append((number, value))
  return message(out)


def rebuild(hash_fn: Hash, shard: Shard, footer_edit: Callable | None = None,
            compression: int = NONE) -> tuple[bytearray, list[Chunk]]:
  """Lays `shard` out again: its chunks (but padding) where they now fall, a
  footer with the record chunks' new offsets (its messages rewritten by
  `footer_edit`, if given), padding to a block boundary, the postscript
  there, and padding to the end of that last block."""
  body = [c for i, c in enumerate(shard.chunks)
          if i not in (shard.footer, shard.postscript) and c.chunk_type != PADDING]
  footer_at = round_up_to_chunk_boundary(plan(body))
  records = [shard.chunks[i] for i in shard.records]
  metadata = honest_metadata(decode_records(shard.chunks[shard.footer])[0], records)
  entries = [message([(1, c.begin), (2, c.decoded_size), (3, c.num_records)]) for c in records]
  if footer_edit is not None:
    metadata, entries = footer_edit(metadata, entries)
  footer = encode_records([metadata, *entries], compression)
  footer.begin = footer_at
  footer_end = _end(footer)
  ps_at = footer_end + (-footer_end % BLOCK)
  pad = padding_to(footer_end, ps_at)
  if pad is None and footer_end != ps_at:  # too close for a padding chunk
    ps_at += BLOCK
    pad = padding_to(footer_end, ps_at)
  postscript = encode_records([message([(1, footer_at), (2, MAGIC)])] * 3, NONE)
  chunks = [*body, footer, *([pad] if pad else []), postscript]
  ps_end = chunk_end(ps_at, len(postscript.data), postscript.num_records)
  last = padding_to(ps_end, ps_at + BLOCK)
  chunks += [last] if last else []
  out = lay_out(hash_fn, chunks)
  assert footer.begin == footer_at and postscript.begin == ps_at, (footer.begin, postscript.begin)
  out.extend(bytes(ps_at + BLOCK - len(out)))
  return out, chunks
