"""Mutations of ArrayRecord shards, from blind byte flips to crafted chunks
whose hashes are all valid (what an attacker who re-signs headers sends).

Three layers, any of which a mutant may go through:
  * structure: the shard is taken apart (tests/fuzz/layout.py), one to three
    chunks or the footer are edited (sizes, counts, zstd frames, trailing
    bytes, chunk types, footer offsets) and it is laid out again, signed;
  * lies: a chunk header field is set in place to a crafted value
    (data_size 2**48, 2**64-1, ...) and the header re-signed, the data hash
    too where the data's extent changed and still lies in the file;
  * bytes: flips, inserts, deletions, truncation, nothing re-signed.
Each step is recorded in words so that a finding can be read, not only
replayed.
"""

from __future__ import annotations

import random
from typing import Callable

import zstandard

import layout
from layout import Chunk

Hash = layout.Hash
EDGE_VALUES = (0, 1, 2, 127, 128, 255, 256, 65_535, 65_536, 1 << 31, 1 << 32, 1 << 48,
               (1 << 56) - 1, 1 << 62, 1 << 63, (1 << 64) - 1)


def _near(rng: random.Random, v: int) -> int:
  """A value near `v`, or an edge value."""
  if rng.random() < 0.4:
    return rng.choice(EDGE_VALUES)
  return max(0, v + rng.choice((-1, 1, -2, 2, 24, -24, 40, rng.randrange(-1000, 1000))))


# ---------------------------------------------------------------------------
# zstd frames built by hand: raw/RLE block layouts zstd itself would not pick.

def _frame_header(size: int | None, window_log: int, single: bool, checksum: bool = False,
                  dict_id: int = 0) -> bytes:
  """RFC 8878 frame header: magic, descriptor, window, dictionary id, content size."""
  if size is None:
    fcs_flag, fcs = 0, b""
    single = False
  elif single and size < 256:
    fcs_flag, fcs = 0, bytes([size])
  elif 256 <= size < 65_536 + 256:
    fcs_flag, fcs = 1, (size - 256).to_bytes(2, "little")
  elif size < 1 << 32:
    fcs_flag, fcs = 2, size.to_bytes(4, "little")
  else:
    fcs_flag, fcs = 3, size.to_bytes(8, "little")
  if fcs_flag == 0 and size is not None and not single:  # 1-byte sizes need single segment
    fcs_flag, fcs = 2, size.to_bytes(4, "little")
  dict_flag, did = (0, b"") if not dict_id else (3, dict_id.to_bytes(4, "little"))
  fhd = fcs_flag << 6 | int(single) << 5 | int(checksum) << 2 | dict_flag
  window = b"" if single else bytes([(max(window_log, 10) - 10) << 3])
  return layout.ZSTD_MAGIC + bytes([fhd]) + window + did + fcs


def _block(kind: int, payload: bytes, size: int, last: bool) -> bytes:
  word = int(last) | kind << 1 | size << 3
  return word.to_bytes(3, "little") + payload


def hand_frame(rng: random.Random, content: bytes) -> tuple[bytes, str]:
  """A frame of raw (and, for runs, RLE) blocks with chosen sizes; sometimes
  invalid on purpose (a block over 128 KiB or the window)."""
  single = rng.random() < 0.5
  declare = rng.random() < 0.8 or single
  window_log = rng.choice((10, 17, 20, max(10, len(content).bit_length())))
  limit = rng.choice((1 << 17, 1 << 17, 1 << 10, 1 << 18, 3000, 65_536))
  blocks, at = [], 0
  while True:
    n = min(len(content) - at, rng.randint(1, limit))
    piece = content[at:at + n]
    last = at + n == len(content)
    if piece and piece == piece[:1] * n and rng.random() < 0.7:
      blocks.append(_block(1, piece[:1], n, last))
    else:
      blocks.append(_block(0, piece, n, last))
    at += n
    if last:
      break
  size = len(content) if declare else None
  if declare and rng.random() < 0.1:
    size = _near(rng, len(content))
  frame = _frame_header(size, window_log, single) + b"".join(blocks)
  return frame, f"hand frame: {len(blocks)} blocks of <= {limit}, window 2**{window_log}, " \
                f"single={single}, content size {size}"


def zstd_frame(rng: random.Random, content: bytes) -> tuple[bytes, str]:
  """`content` as one zstd frame, made one of several ways."""
  r = rng.random()
  if r < 0.35:
    level = rng.choice((-5, 1, 3, 9, 19))
    size, check = rng.random() < 0.8, rng.random() < 0.3
    c = zstandard.ZstdCompressor(level=level, write_content_size=size, write_checksum=check)
    return c.compress(content), f"zstd level {level} content_size={size} checksum={check}"
  if r < 0.7:
    return hand_frame(rng, content)
  if r < 0.8 and content:  # two frames that decode to the content between them
    cut = rng.randrange(len(content) + 1)
    c = zstandard.ZstdCompressor()
    return c.compress(content[:cut]) + c.compress(content[cut:]), f"two frames cut at {cut}"
  if r < 0.9:  # a skippable frame before or after
    skip = (0x184D2A50 + rng.randrange(16)).to_bytes(4, "little") + (3).to_bytes(4, "little")
    frame = zstandard.ZstdCompressor().compress(content)
    if rng.random() < 0.5:
      return skip + b"abc" + frame, "skippable frame first"
    return frame + skip + b"abc", "skippable frame after"
  frame = zstandard.ZstdCompressor(write_content_size=True).compress(content)
  return _frame_surgery(rng, frame)


def _frame_surgery(rng: random.Random, frame: bytes) -> tuple[bytes, str]:
  """A valid frame, then one of its header or block bits changed."""
  b = bytearray(frame)
  r = rng.random()
  if r < 0.2:
    b[4] ^= 1 << rng.randrange(8)
    return bytes(b), "frame descriptor bit flipped"
  if r < 0.4 and len(b) > 6:
    i = rng.randrange(5, min(len(b), 14))
    b[i] = rng.randrange(256)
    return bytes(b), f"frame byte {i} set"
  if r < 0.6 and len(b) > 2:
    cut = rng.randrange(1, len(b))
    return bytes(b[:cut]), f"frame cut at {cut} of {len(b)}"
  if r < 0.8 and len(b) > 8:
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b), f"frame bit flipped at {i}"
  return bytes(b) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))), \
      "bytes after the frame"


def _varint_odd(rng: random.Random, v: int) -> tuple[bytes, str]:
  """`v` as a varint, or an encoding riegeli would not write (padded with
  continuation bytes, 10 bytes that overflow 64 bits, 11 bytes)."""
  r = rng.random()
  plain = layout.varint(v)
  if r < 0.5 or len(plain) >= 10:
    return plain, f"varint {v}"
  if r < 0.75:
    pad = rng.randint(1, 10 - len(plain))
    body = bytearray(b | 0x80 for b in plain) + bytearray(b"\x80" * (pad - 1)) + b"\x00"
    return bytes(body), f"varint {v} padded to {len(body)} bytes"
  if r < 0.9:
    body = bytearray(b | 0x80 for b in plain) + bytearray(b"\x80" * (9 - len(plain)))
    return bytes(body) + bytes([rng.choice((2, 3, 0x7F))]), f"varint {v} overflowing 64 bits"
  return b"\x80" * 10 + b"\x00", "11-byte varint"


# ---------------------------------------------------------------------------
# Chunk edits: each takes the chunk and returns (new chunk, description).

def _parts(chunk: Chunk) -> tuple[int, bytes, bytes, list[int], bytes] | None:
  """(compression, sizes part, values part, sizes, values) or None if not decodable."""
  try:
    compression, sizes_part, values_part = layout.split_simple(chunk.data)
    sizes_raw = layout.decompress(compression, sizes_part)
    values = layout.decompress(compression, values_part)
    sizes, pos = [], 0
    while pos < len(sizes_raw):
      n, pos = layout.read_varint(sizes_raw, pos)
      sizes.append(n)
    return compression, sizes_part, values_part, sizes, values
  except (IndexError, ValueError, zstandard.ZstdError):
    return None


def _encode_part(rng: random.Random, compression: int, raw: bytes, prefix: int | None = None
                 ) -> tuple[bytes, str]:
  if compression != layout.ZSTD:
    return raw, ""
  frame, how = zstd_frame(rng, raw)
  return layout.varint(len(raw) if prefix is None else prefix) + frame, how


def edit_recompress(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  parts = _parts(chunk)
  if parts is None or parts[0] != layout.ZSTD:
    return edit_bytes(rng, chunk)
  compression, sizes_part, _, sizes, values = parts
  which = rng.random()
  how = []
  if which < 0.7:
    values_part, h = _encode_part(rng, compression, values)
    how.append(f"values: {h}")
  else:
    values_part = parts[2]
  if which > 0.5:
    sizes_part, h = _encode_part(rng, compression, b"".join(layout.varint(s) for s in sizes))
    how.append(f"sizes: {h}")
  data = layout.join_simple(compression, sizes_part, values_part)
  return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size, data), \
      "recompressed " + "; ".join(how)


def edit_sizes(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """The record sizes: one changed, added, dropped, or oddly encoded; the
  header's counts left as they were or made to agree."""
  parts = _parts(chunk)
  if parts is None:
    return edit_bytes(rng, chunk)
  compression, _, values_part, sizes, values = parts
  sizes = list(sizes)
  r = rng.random()
  encoded = [layout.varint(s) for s in sizes]
  if r < 0.3 and sizes:
    i = rng.randrange(len(sizes))
    sizes[i] = _near(rng, sizes[i])
    encoded[i] = layout.varint(sizes[i])
    what = f"size {i} -> {sizes[i]}"
  elif r < 0.45 and len(sizes) >= 2:  # two sizes that still add up
    i, j = rng.sample(range(len(sizes)), 2)
    d = rng.choice((1, sizes[i], (1 << 64) - 1))
    sizes[i] = (sizes[i] - d) % (1 << 64)
    sizes[j] = (sizes[j] + d) % (1 << 64)
    encoded[i], encoded[j] = layout.varint(sizes[i]), layout.varint(sizes[j])
    what = f"sizes {i},{j} moved by {d} (sum mod 2**64 kept)"
  elif r < 0.6:
    v = _near(rng, 0)
    encoded.insert(rng.randrange(len(encoded) + 1), layout.varint(v))
    what = f"extra size {v}"
  elif r < 0.7 and encoded:
    del encoded[rng.randrange(len(encoded))]
    what = "a size dropped"
  elif sizes:
    i = rng.randrange(len(sizes))
    encoded[i], what = _varint_odd(rng, sizes[i])
    what = f"size {i} as {what}"
  else:
    return edit_bytes(rng, chunk)
  sizes_part, how = _encode_part(rng, compression, b"".join(encoded))
  data = layout.join_simple(compression, sizes_part, values_part)
  num_records = chunk.num_records if rng.random() < 0.5 else len(encoded)
  return Chunk(chunk.chunk_type, num_records, chunk.decoded_size, data), \
      f"{what}; {num_records} records in the header {how}"


def edit_trailing(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """Bytes after the values, or after the sizes inside their part."""
  parts = _parts(chunk)
  extra = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 3, 8, 100))))
  if parts is None:
    return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size,
                 chunk.data + extra), f"{len(extra)} bytes appended"
  compression, sizes_part, values_part, _, _ = parts
  if rng.random() < 0.6:
    values_part += extra
    where = "values"
  else:
    sizes_part += extra
    where = "sizes"
  return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size,
               layout.join_simple(compression, sizes_part, values_part)), \
      f"{len(extra)} bytes after the {where}"


def edit_header_counts(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """num_records or decoded_data_size changed (the layout signs it)."""
  if rng.random() < 0.5:
    n = _near(rng, chunk.num_records) % (1 << 56)
    return Chunk(chunk.chunk_type, n, chunk.decoded_size, chunk.data), f"num_records -> {n}"
  n = _near(rng, chunk.decoded_size)
  return Chunk(chunk.chunk_type, chunk.num_records, n, chunk.data), f"decoded_data_size -> {n}"


def edit_framing(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """The compression byte, the size of the sizes, or zstd's size prefix."""
  data = bytearray(chunk.data)
  parts = _parts(chunk)
  r = rng.random()
  if r < 0.3 or parts is None:
    if not data:
      return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size, b"\x00"), "data b'\\0'"
    data[0] = rng.choice((0, ord("z"), ord("b"), ord("s"), rng.randrange(256)))
    return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size, bytes(data)), \
        f"compression byte -> {data[0]:#x}"
  compression, sizes_part, values_part, sizes, values = parts
  if r < 0.6:
    n, _ = _varint_odd(rng, _near(rng, len(sizes_part)))
    data = bytes([compression]) + n + sizes_part + values_part
    return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size, data), \
        f"size of sizes -> {n.hex()}"
  if compression != layout.ZSTD:
    return edit_bytes(rng, chunk)
  _, pos = layout.read_varint(values_part, 0)
  prefix, what = _varint_odd(rng, _near(rng, len(values)))
  values_part = prefix + values_part[pos:]
  return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size,
               layout.join_simple(compression, sizes_part, values_part)), \
      f"values size prefix -> {what}"


def edit_type(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  t = rng.choice((ord("t"), ord("p"), ord("m"), ord("s"), 0, rng.randrange(256)))
  n = chunk.num_records if rng.random() < 0.7 else 0
  return Chunk(t, n, chunk.decoded_size, chunk.data), f"chunk type -> {t:#x}, {n} records"


def edit_records(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """Other records, honestly encoded: a valid chunk both readers must agree on."""
  n = chunk.num_records if rng.random() < 0.8 else rng.randint(0, 5)
  records = [bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 5, 300))))
             for _ in range(min(n, 64))]
  compression = chunk.data[0] if chunk.data and chunk.data[0] in (0, layout.ZSTD) else 0
  out = layout.encode_records(records, compression)
  return out, f"{len(records)} new records, compression {compression:#x}"


def edit_bytes(rng: random.Random, chunk: Chunk) -> tuple[Chunk, str]:
  """A few data bytes flipped, inserted or removed (then signed)."""
  data = bytearray(chunk.data)
  what = []
  for _ in range(rng.randint(1, 3)):
    r = rng.random()
    i = rng.randrange(len(data) + 1)
    if r < 0.5 and i < len(data):
      data[i] ^= 1 << rng.randrange(8)
      what.append(f"flip@{i}")
    elif r < 0.75:
      data[i:i] = bytes([rng.randrange(256)])
      what.append(f"insert@{i}")
    elif data:
      del data[min(i, len(data) - 1)]
      what.append(f"delete@{i}")
  return Chunk(chunk.chunk_type, chunk.num_records, chunk.decoded_size, bytes(data)), \
      "data " + ",".join(what)


CHUNK_EDITS: list[Callable[[random.Random, Chunk], tuple[Chunk, str]]] = [
    edit_recompress, edit_sizes, edit_trailing, edit_header_counts, edit_framing,
    edit_type, edit_records, edit_bytes,
]


# ---------------------------------------------------------------------------
# Footer edits: ArrayRecord's index of chunks.

def footer_edit(rng: random.Random) -> tuple[Callable, str]:
  r = rng.random()
  what = []

  def edit(metadata: bytes, entries: list[bytes]) -> tuple[bytes, list[bytes]]:
    entries = list(entries)
    if r < 0.3 and entries:
      i = rng.randrange(len(entries))
      f = dict(layout.fields_of(entries[i]))
      f[3] = _near(rng, f.get(3, 1)) % (1 << 63)
      entries[i] = layout.message(list(f.items()))
      what.append(f"footer: chunk {i} holds {f[3]} records")
    elif r < 0.55 and entries:
      i = rng.randrange(len(entries))
      f = dict(layout.fields_of(entries[i]))
      off = f[1]
      f[1] = rng.choice((off + 1, off - 1, off + 24, off - off % 65_536 + rng.randrange(1, 25),
                         0, 64, _near(rng, off))) % (1 << 63)
      entries[i] = layout.message(list(f.items()))
      what.append(f"footer: chunk {i} at {f[1]} (was {off})")
    elif r < 0.65 and entries:
      i = rng.randrange(len(entries))
      entries[i] = entries[i] + layout.message([(1, 64)])  # a repeated field: last one wins
      what.append(f"footer: chunk {i} offset given twice")
    elif r < 0.75:
      if entries and rng.random() < 0.5:
        entries.pop(rng.randrange(len(entries)))
        what.append("footer: an entry dropped")
      else:
        entries.append(entries[-1] if entries else layout.message([(1, 64), (3, 1)]))
        what.append("footer: an entry repeated")
    else:
      fields = layout.fields_of(metadata)
      inner = dict(layout.fields_of(next(v for n, v in fields if n == 1)))
      key = rng.choice((1, 2, 3))
      inner[key] = _near(rng, inner.get(key, 0)) % (1 << 63)
      metadata = layout.message([(1, layout.message(list(inner.items())))])
      what.append(f"footer metadata field {key} -> {inner[key]}")
    return metadata, entries
  return edit, what  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# In-place lies and raw bytes, on a laid-out file.

def _header_places(file: bytes | bytearray, begin: int) -> list[int]:
  return layout.physical(begin, layout.CHUNK_HEADER)


def lie(rng: random.Random, hash_fn: Hash, file: bytearray, begin: int) -> str:
  """Sets a field of the chunk header at `begin` and signs the header (and
  the data, when its new extent is still inside the file)."""
  places = _header_places(file, begin)
  if places[-1] >= len(file):
    return "lie skipped (header past the end)"
  header = bytearray(file[i] for i in places)
  data_size = layout.le64(header[8:16])
  field = rng.choice((8, 8, 8, 24, 24, 32, 32, 16))
  if field == 8:
    new = rng.choice((1 << 48, (1 << 64) - 1, 1 << 63, 1 << 32, data_size + 1, data_size - 1,
                      data_size + 24, data_size + 65_536, 0, _near(rng, data_size))) % (1 << 64)
    what = f"data_size {data_size} -> {new}"
    header[8:16] = layout.u64(new)
    data_at = layout.physical(places[-1] + 1, min(new, 1 << 22)) if new < 1 << 22 else []
    if data_at and data_at[-1] < len(file):
      header[16:24] = layout.u64(hash_fn(bytes(file[i] for i in data_at)))
      what += " (data hash over the new extent)"
  elif field == 24:
    t = layout.le64(header[24:32])
    if rng.random() < 0.5:
      n = rng.choice(((t >> 8) + 1, (t >> 8) - 1, 0, (1 << 56) - 1, 1 << 40)) % (1 << 56)
      header[24:32] = layout.u64((t & 0xFF) | n << 8)
      what = f"num_records {t >> 8} -> {n}"
    else:
      c = rng.choice((ord("t"), ord("p"), ord("s"), ord("m"), 0, rng.randrange(256)))
      header[24:32] = layout.u64((t & ~0xFF) | c)
      what = f"chunk_type {t & 0xFF:#x} -> {c:#x}"
  elif field == 32:
    d = layout.le64(header[32:40])
    new = rng.choice((1 << 60, (1 << 64) - 1, d + 1, d - 1, 0, 1 << 31, _near(rng, d))) % (1 << 64)
    header[32:40] = layout.u64(new)
    what = f"decoded_data_size {d} -> {new}"
  else:
    header[16:24] = layout.u64(rng.getrandbits(64))
    what = "data hash replaced"
  header[0:8] = layout.u64(hash_fn(bytes(header[8:])))
  for i, b in zip(places, header):
    file[i] = b
  return f"lie at chunk {begin}: {what}"


def raw(rng: random.Random, file: bytearray, hot: list[int]) -> str:
  """Unsigned byte damage, often near a chunk or block header (`hot`)."""
  what = []
  for _ in range(rng.randint(1, 4)):
    if not file:
      break
    base = rng.choice(hot) if hot and rng.random() < 0.6 else rng.randrange(len(file))
    i = min(len(file) - 1, max(0, base + rng.randrange(-8, 48)))
    r = rng.random()
    if r < 0.5:
      file[i] ^= 1 << rng.randrange(8)
      what.append(f"flip@{i}")
    elif r < 0.65:
      file[i] = rng.choice((0, 0xFF, rng.randrange(256)))
      what.append(f"set@{i}")
    elif r < 0.75:
      file[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 30)))
      what.append(f"insert@{i}")
    elif r < 0.85:
      n = rng.randint(1, 30)
      del file[i:i + n]
      what.append(f"delete {n}@{i}")
    elif r < 0.95:
      cut = rng.randrange(len(file))
      del file[cut:]
      what.append(f"truncate@{cut}")
    else:
      file.extend(bytes(rng.randrange(256) for _ in range(rng.randint(1, 100))))
      what.append("append")
  return "bytes: " + ",".join(what)


def mutate(rng: random.Random, seed: bytes, hash_fn: Hash) -> tuple[bytes, list[str]]:
  """One mutant of the shard `seed` and the steps that made it."""
  steps: list[str] = []
  shard = layout.parse_shard(seed)
  r = rng.random()
  if r < 0.65:
    edit = None
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
      if not shard.records or rng.random() < 0.15:  # an empty shard: its footer
        edit, what = footer_edit(rng)
        steps.append(what)  # filled in when the footer is built
        continue
      k = rng.choice(shard.records)
      if rng.random() < 0.05:  # a record chunk twice, or one left out
        k2 = rng.choice(shard.records)
        shard.records[shard.records.index(k2)] = k
        steps.append(f"chunk {shard.records.index(k)} listed in place of another")
        continue
      fn = rng.choice(CHUNK_EDITS)
      shard.chunks[k], what = fn(rng, shard.chunks[k])
      steps.append(f"chunk {shard.records.index(k)}: {what}")
    records = [shard.chunks[i] for i in shard.records]
    file, chunks = layout.rebuild(hash_fn, shard, edit,
                                  compression=layout.ZSTD if rng.random() < 0.2 else layout.NONE)
    steps = [s if isinstance(s, str) else "; ".join(s) or "footer edit (none)" for s in steps]
  else:
    file, chunks = bytearray(seed), shard.chunks
    records = [shard.chunks[i] for i in shard.records]
  begins = [c.begin for c in chunks]
  records = [c.begin for c in records] or begins
  if r >= 0.65 or rng.random() < 0.3:
    target = rng.choice(records) if rng.random() < 0.85 else rng.choice(begins)
    steps.append(lie(rng, hash_fn, file, target))
  if r >= 0.9 or rng.random() < 0.1:
    hot = begins + [b - b % layout.BLOCK for b in begins]
    steps.append(raw(rng, file, hot))
  return bytes(file), steps
