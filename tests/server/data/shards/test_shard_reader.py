"""server/data/shards/reader.py against ArrayRecord's own reader, byte for byte;
riegeli's hashes against the values in its format specification; corrupt,
truncated and unsupported shards."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from grain_elevator.proto.errors import ConfigError, DataLossError
from grain_elevator.server.data.elevator_dataset import ElevatorDataset
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.shards import chunks
from grain_elevator.server.data.shards import reader as shard_reader

pytestmark = pytest.mark.skipif(not shard_reader.available(),
                                reason="grain_elevator.server.data.shards._riegeli was not built")

# The first 64 bytes of every riegeli file (riegeli_records_file_format.md):
# a block header, then the signature chunk's header; both carry HighwayHashes.
RIEGELI_FIRST_64 = bytes.fromhex(
    "83af70d10d884a3f 0000000000000000"
    "4000000000000000 91bac23c9287e1a9"
    "0000000000000000 e19f13c0e9b1c372"
    "7300000000000000 0000000000000000")


def _write(path, records, options: str) -> str:
  writer = ArrayRecordWriter(str(path), options)
  for r in records:
    writer.write(r)
  writer.close()
  return str(path)


def _records(sizes, copies: int = 5, seed: int = 0) -> list[bytes]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, s, dtype=np.uint8).tobytes() for s in list(sizes) * copies]


@pytest.mark.parametrize("portable", [False, True])
def test_hash_matches_the_values_riegeli_writes(portable):
  from grain_elevator.server.data.shards import _riegeli
  le64 = lambda b: int.from_bytes(b, "little")
  assert _riegeli.hash(b"", portable) == le64(RIEGELI_FIRST_64[40:48])  # data_hash of no data
  assert _riegeli.hash(RIEGELI_FIRST_64[8:24], portable) == le64(RIEGELI_FIRST_64[0:8])
  assert _riegeli.hash(RIEGELI_FIRST_64[32:64], portable) == le64(RIEGELI_FIRST_64[24:32])


def test_hash_lanes_agree_at_every_tail_length():
  """The AVX2 and portable lanes (whichever this CPU runs) on 0..300 bytes
  and across 64 KiB, from aligned and unaligned starts."""
  from grain_elevator.server.data.shards import _riegeli
  data = os.urandom(140_000)
  for n in [*range(301), 65_535, 65_536, 131_073]:
    for start in (0, 3):
      chunk = data[start:start + n]
      assert _riegeli.hash(chunk) == _riegeli.hash(chunk, True), (n, start)


@pytest.mark.parametrize("options", [
    "group_size:1", "group_size:1,uncompressed", "group_size:3", "zstd:1,group_size:2",
    "group_size:64,uncompressed", "",
])
@pytest.mark.parametrize("sizes", [
    [3_088], [153_616], [0, 1, 40, 65_512, 65_536, 131_072], range(70), [],
], ids=["small", "large", "edges", "ramp", "empty"])
def test_reads_what_array_record_reads(tmp_path, options, sizes):
  records = _records(sizes)
  path = _write(tmp_path / "s.array_record", records, options)
  reader = shard_reader.open_shard(path)
  assert reader is not None
  assert reader.num_records == ArrayRecordReader(path).num_records() == len(records)
  order = np.random.default_rng(1).permutation(len(records)).tolist()
  got = reader.read(order)
  assert got == [records[i] for i in order]
  assert all(type(r) is bytes for r in got)


@pytest.mark.parametrize("options", ["group_size:1,uncompressed", "group_size:2,uncompressed"])
def test_chunks_across_block_headers(tmp_path, options):
  """A first record of 65,420-65,560 B moves the next chunk's header across
  the 64 KiB block header, byte by byte (and onto it exactly)."""
  path = tmp_path / "s.array_record"
  for first in range(65_420, 65_560, 3):
    records = [os.urandom(first)] + [bytes([i]) * (37 * i) for i in range(1, 6)]
    reader = shard_reader.ShardReader(_write(path, records, options))
    assert reader.read(list(range(len(records)))) == records, first
    reader.close()


@pytest.mark.parametrize("options", ["group_size:1,brotli", "group_size:1,snappy",
                                     "group_size:1,transpose"])
def test_other_encodings_are_left_to_array_record(tmp_path, options):
  records = _records([100, 3_000])
  path = _write(tmp_path / "s.array_record", records, options)
  assert shard_reader.open_shard(path) is None
  source = BatchedArrayRecordSource([path])
  assert list(source._getitems([3, 0, 9])) == [records[3], records[0], records[9]]  # pylint: disable=protected-access


def test_keys_map_to_the_records_array_record_gives(tmp_path):
  """A batch's keys split over shards, including shards read in part
  ("file[a:b]"), as ArrayRecord's own source maps them."""
  import grain  # pylint: disable=g-import-not-at-top
  shards = [_write(tmp_path / f"k{i}.array_record", _records([300 + i], copies=9 + i, seed=i),
                   "group_size:1") for i in range(3)]
  paths = [f"{shards[0]}[2:7]", shards[1], f"{shards[2]}[4:11]"]
  source = BatchedArrayRecordSource(paths)
  reference = grain.sources.ArrayRecordDataSource(paths)
  keys = [len(source) - 1, 0, 5, 4, 16, 6, 5, len(source) - 7]
  assert list(source._getitems(keys)) == [reference[k] for k in keys]  # pylint: disable=protected-access
  copy = pickle.loads(pickle.dumps(source))  # as Grain's worker processes get it
  assert list(copy._getitems(keys)) == [reference[k] for k in keys]  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=rf"record keys must be in \[0, {len(source)}\)"):
    source._getitems([0, len(source)])  # pylint: disable=protected-access


def test_threads_share_a_reader(tmp_path):
  records = _records([3_088, 70_000], copies=20)
  reader = shard_reader.ShardReader(_write(tmp_path / "s.array_record", records, "group_size:1"))
  errors: list[BaseException] = []

  def work(seed: int) -> None:
    rng = np.random.default_rng(seed)
    try:
      for _ in range(30):
        idx = rng.integers(0, len(records), 8).tolist()
        assert reader.read(idx) == [records[i] for i in idx]
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]


def _chunk_begin(path: str, record: int) -> int:
  reader = shard_reader.ShardReader(path)
  begin = int(reader._begins[record])  # pylint: disable=protected-access
  reader.close()
  return begin


@pytest.mark.parametrize("where,message", [
    (41, "data hash mismatch"),    # a byte of the chunk's data
    (12, "header hash mismatch"),  # data_size, in the chunk header
])
def test_corruption_names_shard_and_record(tmp_path, where, message):
  records = _records([500], copies=12)
  path = _write(tmp_path / "c.array_record", records, "group_size:1")
  begin = _chunk_begin(path, 7)
  data = bytearray(open(path, "rb").read())
  data[begin + where] ^= 0x40
  open(path, "wb").write(bytes(data))
  reader = shard_reader.ShardReader(path)
  assert reader.read([6, 8]) == [records[6], records[8]]  # the rest still reads
  with pytest.raises(shard_reader.CorruptShard, match=message):
    reader.read([7])
  source = BatchedArrayRecordSource([path])
  with pytest.raises(DataLossError, match=rf"shard {path} is corrupt: record 7 cannot be "
                                          rf"read: {path}: chunk at byte {begin}: {message}"):
    source._getitems([2, 7])  # pylint: disable=protected-access


def test_shard_truncated_while_open_is_data_loss_not_a_crash(tmp_path):
  records = _records([20_000], copies=50)
  path = _write(tmp_path / "t.array_record", records, "group_size:1")
  source = BatchedArrayRecordSource([path])
  assert source._getitems([0]) == [records[0]]  # pylint: disable=protected-access
  os.truncate(path, _chunk_begin(path, 30) + 100)
  with pytest.raises(DataLossError, match="record 40 cannot be read: .*ends before"):
    source._getitems([40])  # pylint: disable=protected-access


def test_truncated_shard_fails_to_open(tmp_path):
  path = _write(tmp_path / "t.array_record", _records([3_000], copies=30), "group_size:1")
  os.truncate(path, os.path.getsize(path) - 1000)
  with pytest.raises(shard_reader.CorruptShard):
    shard_reader.open_shard(path)


def test_env_chooses_array_record(tmp_path, monkeypatch, config_path):
  path = _write(tmp_path / "s.array_record", _records([10]), "group_size:1")
  monkeypatch.setenv(shard_reader.READER_ENV, "arrayrecord")
  assert shard_reader.open_shard(path) is None
  monkeypatch.setenv(shard_reader.READER_ENV, "fast")
  with pytest.raises(ValueError, match="ELEVATOR_SHARD_READER='fast': expected one of"):
    shard_reader.open_shard(path)
  from grain_elevator.server.data import config as config_lib
  config = config_lib.load_config(config_path).datasets["plain"]
  with pytest.raises(ConfigError, match="ELEVATOR_SHARD_READER"):
    ElevatorDataset(config)


def test_malformed_footer_messages_are_refused():
  from grain_elevator.server.data.shards import _riegeli
  sizes = np.array([3], np.uint64).tobytes()
  assert np.frombuffer(_riegeli.message_field(b"\x08\x96\x01", sizes, 1), np.uint64) == [150]
  with pytest.raises(ValueError, match="malformed"):
    _riegeli.message_field(b"\x08\x96", np.array([2], np.uint64).tobytes(), 1)
  with pytest.raises(ValueError, match="malformed"):
    _riegeli.message_field(b"\x08", np.array([5], np.uint64).tobytes(), 1)
  with pytest.raises(ValueError, match="truncated or too long"):
    _riegeli.varints(b"\x80\x80", 1)


def test_reads_a_shard_that_is_not_in_the_page_cache(tmp_path):
  """Small chunks are read with RWF_NOWAIT while the GIL is held; a shard
  evicted from the page cache takes the blocking read instead."""
  records = _records([3_000, 200], copies=20)
  path = _write(tmp_path / "cold.array_record", records, "group_size:1")
  reader = shard_reader.ShardReader(path)
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  assert reader.read(list(range(len(records)))[::-1]) == records[::-1]


def _advance(pos: int, n: int) -> int:
  """The file position `n` bytes of chunk data after `pos`, past block headers."""
  while True:
    if pos % 65_536 < 24:
      pos += 24 - pos % 65_536
    if not n:
      return pos
    step = min(n, 65_536 - pos % 65_536)
    pos, n = pos + step, n - step


def _big_records() -> list[bytes]:
  """Big records as zstd stores them: raw blocks (random bytes, 1-3 and 70
  blocks), compressed blocks (a pattern), and both in one frame."""
  rng = np.random.default_rng(3)
  noise = lambda n: rng.integers(0, 256, n, dtype=np.uint8).tobytes()
  return [noise(153_616), noise(70_000), noise(300_001), b"ab" * 80_000,
          noise(100_000) + bytes(100_000), noise(9 << 20)]


@pytest.mark.parametrize("options", ["group_size:1", "group_size:1,uncompressed"])
def test_big_records_read_straight_into_place(tmp_path, options):
  """Raw-block and uncompressed records take `read_record`; compressed or
  mixed frames, and frames of over 64 blocks, fall back to decompressing."""
  from grain_elevator.server.data.shards import _riegeli
  records = _big_records()
  path = _write(tmp_path / "big.array_record", records, options)
  reader = shard_reader.ShardReader(path)
  assert reader.read([5, 0, 3, 1, 4, 2]) == [records[i] for i in (5, 0, 3, 1, 4, 2)]
  direct = [_riegeli.read_record(reader._fd, int(b), int(e))  # pylint: disable=protected-access
            for b, e in zip(reader._begins, reader._ends)]  # pylint: disable=protected-access
  if "uncompressed" in options:
    assert direct == records
  else:  # zstd: raw blocks only for the random records of up to 64 blocks
    assert [d is not None for d in direct] == [True, True, True, False, False, False]
    assert direct[:3] == records[:3]


@pytest.mark.parametrize("where,message", [
    (100_000, "data hash mismatch"),  # a payload byte, past the first 64 KiB block
    (-1, "data hash mismatch"),       # the second zstd block header: compressed now
])
def test_corrupt_big_record(tmp_path, where, message):
  records = _big_records()[:3]
  path = _write(tmp_path / "big.array_record", records, "group_size:1")
  begin = _chunk_begin(path, 2)
  data = bytearray(open(path, "rb").read())
  if where < 0:  # the values' frame (the record sizes have one first): after its
    magic = b"\x28\xb5\x2f\xfd"  # header (6 B), a block header and 128 KiB of payload
    frame = data.index(magic, data.index(magic, begin) + 4)
    at = _advance(frame, 6 + 3 + (128 << 10))
    assert data[at] & 0x06 == 0  # a raw block
    data[at] |= 0x04  # now "compressed"
  else:
    data[begin + where] ^= 0x01
  open(path, "wb").write(bytes(data))
  reader = shard_reader.ShardReader(path)
  assert reader.read([0, 1]) == records[:2]
  with pytest.raises(shard_reader.CorruptShard, match=message):
    reader.read([2])


def _logical(pos: int, n: int) -> list[int]:
  """The file positions of `n` bytes of chunk data from `pos`, past block headers."""
  out: list[int] = []
  while len(out) < n:
    pos = _advance(pos, 0)
    step = min(n - len(out), 65_536 - pos % 65_536)
    out.extend(range(pos, pos + step))
    pos += step
  return out


def test_big_record_with_uneven_raw_blocks(tmp_path):
  """read_record reads a record's payloads and zstd block headers with one
  preadv, assuming the blocks zstd cuts incompressible data into: one size,
  the last shorter. Here a valid frame cuts them 128 KiB, ~99 KiB, ~66 KiB:
  the header read at the assumed place disagrees, and the record is read by
  the headers in the file instead, still straight into place."""
  from grain_elevator.server.data.shards import _riegeli
  records = _big_records()[:3]  # record 2: 300,001 B, raw blocks of 128, 128, 37 KiB
  path = _write(tmp_path / "big.array_record", records, "group_size:1")
  data = bytearray(open(path, "rb").read())
  head = _logical(_chunk_begin(path, 2), 40)
  header = bytearray(data[i] for i in head)
  where = _logical(head[-1] + 1, int.from_bytes(header[8:16], "little"))
  chunk = bytearray(data[i] for i in where)
  magic = b"\x28\xb5\x2f\xfd"
  at = chunk.index(magic, chunk.index(magic) + 4) + 6  # the values' first block header
  words = []
  while True:
    word = int.from_bytes(chunk[at:at + 3], "little")
    assert word & 6 == 0  # raw
    words.append((at, word >> 3))
    at += 3 + (word >> 3)
    if word & 1:
      break
  assert [size for _, size in words] == [128 << 10, 128 << 10, 300_001 - (256 << 10)]
  (_, _), (second, size2), (third, size3) = words
  moved = 30_000
  payload = chunk[second + 3:second + 3 + size2] + chunk[third + 3:third + 3 + size3]
  chunk[second:] = ((size2 - moved) << 3).to_bytes(3, "little") + payload[:size2 - moved] + (
      ((size3 + moved) << 3) | 1).to_bytes(3, "little") + payload[size2 - moved:]
  assert len(chunk) == len(where)
  header[16:24] = _riegeli.hash(bytes(chunk)).to_bytes(8, "little")
  header[0:8] = _riegeli.hash(bytes(header[8:])).to_bytes(8, "little")
  for i, b in zip(head + where, header + chunk):
    data[i] = b
  open(path, "wb").write(bytes(data))

  reader = shard_reader.ShardReader(path)
  begin, end = int(reader._begins[2]), int(reader._ends[2])  # pylint: disable=protected-access
  assert _riegeli.read_record(reader._fd, begin, end) == records[2]  # pylint: disable=protected-access
  assert reader.read([2, 0, 1]) == [records[2], records[0], records[1]]
  assert ArrayRecordReader(path).read([2]) == [records[2]]  # still a valid shard


def test_big_record_truncated_while_open(tmp_path):
  records = _big_records()[:3]
  path = _write(tmp_path / "big.array_record", records, "group_size:1")
  reader = shard_reader.ShardReader(path)
  os.truncate(path, _chunk_begin(path, 2) + 200_000)
  with pytest.raises(shard_reader.CorruptShard, match="ends before"):
    reader.read([2])


@pytest.mark.parametrize("read", ["read_chunk", "read_record"])
def test_bad_extents_are_refused(tmp_path, read):
  """What a footer with bad chunk offsets would ask for."""
  from grain_elevator.server.data.shards import _riegeli
  path = _write(tmp_path / "s.array_record", _records([100]), "group_size:1")
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(ValueError, match="chunk at byte 200: empty extent"):
      getattr(_riegeli, read)(fd, 200, 100)
    with pytest.raises(ValueError, match="chunk at byte 64: its extent is shorter"):
      getattr(_riegeli, read)(fd, 64, 90)
  finally:
    os.close(fd)


def test_corrupt_shard_read_through_array_record_names_the_record(tmp_path, monkeypatch):
  """The fallback path names the record too (brotli shards, no C part)."""
  monkeypatch.setenv(shard_reader.READER_ENV, "arrayrecord")
  records = _records([500], copies=12)
  path = _write(tmp_path / "c.array_record", records, "group_size:1")
  begin = _chunk_begin(path, 7)
  data = bytearray(open(path, "rb").read())
  data[begin + 41] ^= 0x40
  open(path, "wb").write(bytes(data))
  source = BatchedArrayRecordSource([path])
  assert source._getitems([6, 8]) == [records[6], records[8]]  # pylint: disable=protected-access
  with pytest.raises(DataLossError, match=rf"shard {path} is corrupt: record 7 cannot be read"):
    source._getitems([2, 7])  # pylint: disable=protected-access


# Crafted chunks whose hashes are valid (re-signed): the reader must bound
# every size before it uses it, and refuse what ArrayRecord would refuse.

def _resign(path: str, record: int, *, header_edit=None, data_edit=None) -> int:
  """Edits `record`'s chunk in place (header fields and/or its data, same
  length), then recomputes the data and header hashes. Returns the chunk's
  file offset."""
  from grain_elevator.server.data.shards import _riegeli
  data = bytearray(open(path, "rb").read())
  begin = _chunk_begin(path, record)
  head = _logical(begin, 40)
  header = bytearray(data[i] for i in head)
  where = _logical(head[-1] + 1, int.from_bytes(header[8:16], "little"))
  chunk = bytearray(data[i] for i in where)
  if data_edit:
    data_edit(chunk)
    header[16:24] = _riegeli.hash(bytes(chunk)).to_bytes(8, "little")
  if header_edit:
    header_edit(header)
  header[0:8] = _riegeli.hash(bytes(header[8:])).to_bytes(8, "little")
  for i, b in zip(head + where, header + chunk):
    data[i] = b
  open(path, "wb").write(bytes(data))
  return begin


def _field(offset: int, value: int):
  def edit(header: bytearray) -> None:
    header[offset:offset + 8] = value.to_bytes(8, "little")
  return edit


def _read_bounded(reader, indices) -> BaseException | None:
  """reader.read(indices) in a thread: what it raised; fails if it hangs."""
  out: list = []

  def run():
    try:
      reader.read(indices)
      out.append(None)
    except BaseException as e:  # pylint: disable=broad-except
      out.append(e)
  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(60)
  assert not t.is_alive(), "the reader hangs on a crafted header"
  return out[0]


@pytest.mark.parametrize("sizes", [[500], [300_001]], ids=["small", "big"])
@pytest.mark.parametrize("field,value,message", [
    (8, 1 << 48, "data_size runs past"),
    (8, 2**64 - 1, "data_size runs past"),
    (24, (2 << 8) | ord("r"), "says 2 records, the footer 1"),
])
def test_resigned_headers_are_refused(tmp_path, sizes, field, value, message):
  records = _records(sizes, copies=3)
  path = _write(tmp_path / "r.array_record", records, "group_size:1")
  begin = _resign(path, 1, header_edit=_field(field, value))
  reader = shard_reader.ShardReader(path)
  error = _read_bounded(reader, [1])
  assert isinstance(error, shard_reader.CorruptShard), repr(error)
  assert message in str(error)
  assert reader.read([0, 2]) == [records[0], records[2]]
  source = BatchedArrayRecordSource([path])
  with pytest.raises(DataLossError, match=rf"shard {path} is corrupt: record 1"):
    source._getitems([1])  # pylint: disable=protected-access
  del begin


def test_a_decoded_size_past_the_bound_is_not_allocated(tmp_path):
  records = _records([500], copies=3)
  path = _write(tmp_path / "d.array_record", records, "group_size:1")
  _resign(path, 1, header_edit=_field(32, 1 << 60))
  error = _read_bounded(shard_reader.ShardReader(path), [1])
  assert isinstance(error, (shard_reader.CorruptShard, shard_reader.UnsupportedShard)), error


def _first_block_header(chunk: bytearray) -> int:
  """Offset of the values frame's first zstd block header in a chunk."""
  magic = b"\x28\xb5\x2f\xfd"
  at = chunk.index(magic, chunk.index(magic) + 4)
  fhd = chunk[at + 4]
  fcs = (1 << (fhd >> 6)) if fhd >> 6 else (fhd >> 5) & 1
  return at + 5 + (not (fhd >> 5) & 1) + (0, 1, 2, 4)[fhd & 3] + fcs


def test_a_bad_zstd_block_with_valid_hashes_is_data_loss_not_internal(tmp_path):
  records = [bytes(500)] * 3  # compressible: a compressed block, not raw
  path = _write(tmp_path / "z.array_record", records, "group_size:1")

  def reserved_block_type(chunk: bytearray) -> None:
    at = _first_block_header(chunk)
    chunk[at] |= 0b110  # block type 3: reserved
  begin = _resign(path, 1, data_edit=reserved_block_type)
  reader = shard_reader.ShardReader(path)
  error = _read_bounded(reader, [1])
  assert isinstance(error, shard_reader.CorruptShard), repr(error)
  with pytest.raises(Exception):
    ArrayRecordReader(path).read([1])  # ArrayRecord refuses it too
  source = BatchedArrayRecordSource([path])
  with pytest.raises(DataLossError, match=rf"shard {path} is corrupt: record 1"):
    source._getitems([1])  # pylint: disable=protected-access
  del begin


def test_bytes_after_the_zstd_frame_are_refused():
  import zstandard
  frame = zstandard.ZstdCompressor().compress(bytes(1000))
  block = memoryview(bytes([0xe8, 0x07]) + frame)  # varint 1000, then the frame
  assert chunks.zstd_frame(block)[1] == 1000
  with pytest.raises(shard_reader.CorruptShard, match="3 bytes follow the zstd frame"):
    chunks.zstd_frame(memoryview(bytes(block) + b"xyz"))
  with pytest.raises(shard_reader.CorruptShard, match="declares 1000 bytes, the block says 999"):
    chunks.zstd_frame(memoryview(bytes([0xe7, 0x07]) + frame))
