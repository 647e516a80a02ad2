"""`elevator convert tfrecord`: exact records, determinism, corrupt inputs, atomicity."""

from __future__ import annotations

import gzip
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from grain_elevator.tools import cli
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError
from grain_elevator.tools.convert.tfrecord import TFRecordSource
from helpers import no_leftovers, read_shards, shard_bytes

google_crc32c = pytest.importorskip("google_crc32c")


# -- a TFRecord writer of our own (the converter's framing is not used) --------------

def _masked(data: bytes) -> int:
  crc = google_crc32c.value(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes, *, length: int | None = None) -> bytes:
  header = struct.pack("<Q", len(data) if length is None else length)
  return (header + struct.pack("<I", _masked(header)) + data
          + struct.pack("<I", _masked(data)))


def write_tfrecord(path: pathlib.Path, records: list[bytes], opener=open) -> pathlib.Path:
  with opener(path, "wb") as f:
    for r in records:
      f.write(frame(r))
  return path


@pytest.fixture
def records() -> list[list[bytes]]:
  rng = np.random.default_rng(0)
  files = []
  for f in range(4):
    n = [0, 57, 1, 130][f]  # an empty file, and one of one record
    files.append([rng.bytes(int(rng.integers(0, 300))) for _ in range(n)])
  files[1][3] = b""  # a zero-length record
  return files


@pytest.fixture
def inputs(tmp_path, records) -> pathlib.Path:
  folder = tmp_path / "in"
  folder.mkdir()
  for i, recs in enumerate(records):
    write_tfrecord(folder / f"part-{i:02d}.tfrecord", recs)
  return folder


def convert(inputs, out, **kwargs):
  return shards.convert(TFRecordSource((str(inputs / "*.tfrecord"),)), str(out),
                        progress=False, **kwargs)


# -- known answers --------------------------------------------------------------------

def test_crc32c_and_framing_known_answers():
  assert google_crc32c.value(b"123456789") == 0xE3069283  # the CRC-32C check value
  from grain_elevator.tools.convert.tfrecord import encode_tfrecord, masked_crc32c
  assert masked_crc32c(b"") == _masked(b"")
  assert encode_tfrecord(b"abc") == frame(b"abc")


def test_reads_a_file_tensorflow_wrote():
  """Grain ships a TFRecord file TensorFlow wrote: its CRCs are the reference."""
  import grain  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(grain.__file__).parent / "_src/python/testdata/morris_sequence_first_5.tfrecord"
  if not path.exists():
    pytest.skip(f"{path} is not in this grain version")
  source = TFRecordSource((str(path),))
  ix = source.index(str(path))
  got = list(source.read(source.segment(str(path), ix, 0, ix.count), {}))
  assert got == [b"1", b"1 1", b"2 1", b"1 2 1 1", b"1 1 1 2 2 1"]


# -- exact, deterministic output ------------------------------------------------------

@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_records_come_back_exactly_whatever_the_workers(tmp_path, inputs, records, num_shards):
  want = [r for recs in records for r in recs]
  outs = []
  for workers in (1, 2):
    out = tmp_path / f"w{workers}" / "out"  # same name: the same elevator.toml
    summary = convert(inputs, out, num_shards=num_shards, workers=workers)
    assert summary.records == len(want) and summary.shards == num_shards
    assert read_shards(out) == want
    outs.append(shard_bytes(out))
  assert outs[0] == outs[1]  # byte for byte, whatever the workers
  names = sorted(n for n in outs[0] if n.endswith(".array_record"))
  assert names == [f"train-{s:05d}-of-{num_shards:05d}.array_record" for s in range(num_shards)]


def test_records_are_split_evenly_in_order(tmp_path, inputs, records):
  from array_record.python.array_record_data_source import ArrayRecordDataSource  # pylint: disable=g-import-not-at-top
  convert(inputs, tmp_path / "out", num_shards=5)
  total = sum(map(len, records))
  sizes = [len(ArrayRecordDataSource([str(p)]))
           for p in sorted((tmp_path / "out").glob("*.array_record"))]
  assert sizes == [(s + 1) * total // 5 - s * total // 5 for s in range(5)]


def test_cli_prints_a_config_that_loads(tmp_path, inputs, capsys):
  out = tmp_path / "mydata"
  assert cli.main(["convert", "tfrecord", str(inputs / "*.tfrecord"), str(out),
                   "--shards", "2", "--quiet"]) == 0
  printed = capsys.readouterr()
  assert "[datasets.mydata]" in printed.out
  assert "wrote 188 records in 2 shards" in printed.err
  from grain_elevator.server.data.config import load_config  # pylint: disable=g-import-not-at-top
  (tmp_path / "printed.toml").write_text(printed.out)
  for config in (tmp_path / "printed.toml", out / "elevator.toml"):
    ds = load_config(config).datasets["mydata"]
    assert [os.path.basename(f) for f in ds.files] == [
        "train-00000-of-00002.array_record", "train-00001-of-00002.array_record"]
    assert ds.pipeline is None  # random bytes are not Examples


@pytest.mark.parametrize("ext,opener", [(".tfrecord.gz", gzip.open), (".zz", None)])
def test_compressed_inputs(tmp_path, records, ext, opener):
  folder = tmp_path / "in"
  folder.mkdir()
  for i, recs in enumerate(records):
    path = folder / f"part-{i}{ext}"
    data = b"".join(frame(r) for r in recs)
    if opener:
      write_tfrecord(path, recs, opener)
    else:
      path.write_bytes(zlib.compress(data))
  out = tmp_path / "out"
  shards.convert(TFRecordSource((str(folder / "*"),)), str(out), num_shards=3,
                 workers=1, progress=False)
  assert read_shards(out) == [r for recs in records for r in recs]


# -- damaged inputs: named file and offset, nothing left ------------------------------

def _flip(path: pathlib.Path, offset: int) -> None:
  data = bytearray(path.read_bytes())
  data[offset] ^= 0x40
  path.write_bytes(bytes(data))


def _damage(inputs: pathlib.Path, how: str, records) -> tuple[pathlib.Path, int, str]:
  """Damages the last file; returns it, the bad record's offset, a message part."""
  last = inputs / "part-03.tfrecord"
  offsets = np.cumsum([0] + [len(r) + 16 for r in records[3]])
  k = 100  # the 101st record of the last file
  at = int(offsets[k])
  if how == "data byte":
    _flip(last, at + 12 + len(records[3][k]) // 2 if records[3][k] else at + 12)
    return last, at, "fails its CRC"
  if how == "length byte":
    _flip(last, at + 1)
    return last, at, "length fails its CRC"
  if how == "truncated":
    last.write_bytes(last.read_bytes()[:at + 20])
    return last, at, "truncated"
  if how == "length 2**63":
    data = last.read_bytes()
    header = struct.pack("<Q", 2**63)
    last.write_bytes(data[:at] + header + struct.pack("<I", _masked(header)) + data[at + 12:])
    return last, at, "over the limit"
  raise AssertionError(how)


@pytest.mark.parametrize("how", ["data byte", "length byte", "truncated", "length 2**63"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_damaged_file_fails_naming_file_and_offset(tmp_path, inputs, records, how, workers):
  if not records[3][100]:
    records[3][100] = b"x"
  path, offset, what = _damage(inputs, how, records)
  out = tmp_path / "out"
  with pytest.raises(CorruptInputError) as e:
    convert(inputs, out, num_shards=4, workers=workers)
  assert e.value.path == str(path) and e.value.offset == offset, str(e.value)
  assert f"{path}: at byte {offset}:" in str(e.value) and what in str(e.value)
  no_leftovers(out)


def test_the_cli_reports_a_damaged_file(tmp_path, inputs, records, capsys):
  path, offset, _ = _damage(inputs, "length byte", records)
  out = tmp_path / "out"
  assert cli.main(["convert", "tfrecord", str(inputs / "*.tfrecord"), str(out),
                   "--quiet"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"elevator: error: {path}: at byte {offset}: ")
  no_leftovers(out)


def test_record_size_limit(tmp_path, inputs):
  with pytest.raises(CorruptInputError, match="over the limit of 100"):
    shards.convert(TFRecordSource((str(inputs / "*"),), max_record_bytes=100),
                   str(tmp_path / "out"), progress=False)
  no_leftovers(tmp_path / "out")


def test_no_inputs_or_no_records(tmp_path):
  with pytest.raises(ConvertError, match="matches no files"):
    shards.convert(TFRecordSource((str(tmp_path / "nope*"),)), str(tmp_path / "o"),
                   progress=False)
  write_tfrecord(tmp_path / "empty.tfrecord", [])
  with pytest.raises(ConvertError, match="no records"):
    shards.convert(TFRecordSource((str(tmp_path / "empty*"),)), str(tmp_path / "o"),
                   progress=False)
  with pytest.raises(ConvertError, match="--shards must be between 1 and 2"):
    write_tfrecord(tmp_path / "two.tfrecord", [b"a", b"b"])
    shards.convert(TFRecordSource((str(tmp_path / "two*"),)), str(tmp_path / "o"),
                   num_shards=3, progress=False)
  no_leftovers(tmp_path / "o")


# -- OUT_DIR rules --------------------------------------------------------------------

def test_overwrite_rules(tmp_path, inputs, records):
  want = [r for recs in records for r in recs]
  out = tmp_path / "out"
  out.mkdir()  # an empty folder is fine
  convert(inputs, out, num_shards=3)
  with pytest.raises(ConvertError, match="--overwrite"):
    convert(inputs, out, num_shards=2)
  assert len(list(out.glob("*.array_record"))) == 3  # untouched
  convert(inputs, out, num_shards=2, overwrite=True)
  assert sorted(p.name for p in out.glob("*.array_record")) == [
      "train-00000-of-00002.array_record", "train-00001-of-00002.array_record"]
  assert read_shards(out) == want
  (out / "notes.txt").write_text("mine")
  with pytest.raises(ConvertError, match="notes.txt"):
    convert(inputs, out, num_shards=2, overwrite=True)
  assert (out / "notes.txt").exists()
  other = tmp_path / "other"
  other.mkdir()
  (other / "x").write_text("")
  with pytest.raises(ConvertError, match="not empty"):
    convert(inputs, other, overwrite=True)
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failed_overwrite_keeps_the_old_shards(tmp_path, inputs, records):
  out = tmp_path / "out"
  convert(inputs, out, num_shards=3)
  before = shard_bytes(out)
  _damage(inputs, "length byte", records)
  with pytest.raises(CorruptInputError):
    convert(inputs, out, num_shards=2, overwrite=True)
  assert shard_bytes(out) == before
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- interrupted runs -----------------------------------------------------------------

@pytest.fixture
def big_input(tmp_path) -> pathlib.Path:
  """~48 MB of TFRecord: enough for a conversion to be caught mid-way."""
  folder = tmp_path / "big"
  folder.mkdir()
  rng = np.random.default_rng(1)
  block = rng.bytes(1 << 20)
  for f in range(4):
    with open(folder / f"part-{f}.tfrecord", "wb") as out:
      for i in range(3000):
        start = (i * 331) % ((1 << 20) - 4096)
        out.write(frame(block[start:start + 4000]))
  return folder


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_run_leaves_no_out_dir(tmp_path, big_input, sig):
  out = tmp_path / "out"
  proc = subprocess.Popen(
      [sys.executable, "-m", "grain_elevator.tools.cli", "convert", "tfrecord",
       str(big_input / "*.tfrecord"), str(out), "--shards", "8", "--workers", "2", "--quiet"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:  # wait until shards are being written
    staged = list(tmp_path.glob(".out.convert-*.tmp/*"))
    if staged or proc.poll() is not None:
      break
    time.sleep(0.01)
  assert proc.poll() is None, "finished before it could be interrupted: make the input bigger"
  proc.send_signal(sig)
  proc.wait(30)
  assert not out.exists()
  hidden = list(tmp_path.glob(".out.convert-*"))
  if sig == signal.SIGTERM:
    assert proc.returncode == 143, proc.stderr.read().decode()
    assert not hidden  # cleaned up
  else:
    # SIGKILL leaves the hidden folder, never an OUT_DIR; the next run names it.
    assert hidden
    notes: list[str] = []
    summary = shards.convert(TFRecordSource((str(big_input / "part-0.tfrecord"),)), str(out),
                             num_shards=1, workers=1, progress=False, log=notes.append)
    assert summary.records == 3000
    assert any(str(hidden[0]) in n and "interrupted" in n for n in notes), notes
  for p in proc.stdout, proc.stderr:
    p.close()
