"""`elevator convert parquet` and `npz`: rows as Examples that `parse_examples`
turns back into exactly the input's values; and one end-to-end run of a real
server on the printed config, against embedded mode."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from grain_elevator.pipelines.tf_example import ExampleParser
from grain_elevator.tools import cli
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert.errors import ConvertError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def read_records(out: pathlib.Path) -> list[bytes]:
  from array_record.python.array_record_data_source import ArrayRecordDataSource  # pylint: disable=g-import-not-at-top
  source = ArrayRecordDataSource(sorted(str(p) for p in out.glob("*.array_record")))
  return [source[i] for i in range(len(source))]


def parsed(out: pathlib.Path) -> list[dict]:
  """The records, through the features spec of OUT_DIR/elevator.toml."""
  from grain_elevator.server.data.config import load_config  # pylint: disable=g-import-not-at-top
  (ds,) = load_config(out / "elevator.toml").datasets.values()
  assert ds.pipeline == "grain_elevator.pipelines.tf_example:parse_examples"
  parser = ExampleParser(ds.options["features"])
  return [parser(r) for r in read_records(out)]


def _table(rng: np.random.Generator, start: int, n: int) -> "pa.Table":
  ids = np.arange(start, start + n)
  return pa.table({
      "id": pa.array(ids, pa.int64()),
      "small": pa.array((ids % 200 - 100).astype(np.int8)),
      "u64": pa.array(np.uint64(2**64 - 1) - ids.astype(np.uint64)),
      "flag": pa.array(ids % 3 == 0),
      "f32": pa.array(rng.standard_normal(n).astype(np.float32)),
      "f64": pa.array(rng.standard_normal(n)),
      "f16": pa.array(rng.standard_normal(n).astype(np.float16)),
      "text": pa.array([f"row {i} " + "é" * (i % 4) for i in ids]),
      "blob": pa.array([bytes([i % 256]) * (i % 5) for i in ids], pa.binary()),
      "fixed": pa.array([bytes([i % 256, 0, 1]) for i in ids], pa.binary(3)),
      "vec": pa.array([np.full(4, i, np.float32) for i in ids], pa.list_(pa.float32(), 4)),
      "mat": pa.array([[[i, 0], [1, i]] for i in ids],
                      pa.list_(pa.list_(pa.int16(), 2), 2)),
      "tags": pa.array([["a", "bc"][: 1 + i % 2] for i in ids], pa.list_(pa.string())),
      "maybe": pa.array([None if i % 4 == 1 else int(i) for i in ids], pa.int32()),
      "cat": pa.array([["x", "yy"][i % 2] for i in ids]).dictionary_encode(),
  })


@pytest.fixture
def parquet_files(tmp_path) -> tuple[pathlib.Path, "pa.Table"]:
  folder = tmp_path / "pq"
  folder.mkdir()
  rng = np.random.default_rng(0)
  tables = [_table(rng, 0, 150), _table(rng, 150, 1), _table(rng, 151, 90)]
  for i, t in enumerate(tables):
    pq.write_table(t, folder / f"part-{i}.parquet", row_group_size=40)
  return folder, pa.concat_tables(tables)


@pytest.mark.parametrize("workers,num_shards", [(1, 1), (2, 4)])
def test_parquet_rows_come_back_exactly(tmp_path, parquet_files, workers, num_shards):
  folder, table = parquet_files
  from grain_elevator.tools.convert.parquet import ParquetSource  # pylint: disable=g-import-not-at-top
  out = tmp_path / "out"
  summary = shards.convert(ParquetSource((str(folder / "*.parquet"),), batch_rows=16), str(out),
                           num_shards=num_shards, workers=workers, progress=False)
  assert summary.records == table.num_rows == 241
  rows = parsed(out)
  cols = table.to_pydict()
  for i, r in enumerate(rows):
    assert r["id"] == cols["id"][i] and r["id"].dtype == np.int64
    assert r["small"] == cols["small"][i] and r["small"].dtype == np.int8
    assert int(r["u64"]) == cols["u64"][i] and r["u64"].dtype == np.uint64
    assert bool(r["flag"]) == cols["flag"][i] and r["flag"].dtype == np.bool_
    assert r["f32"].tobytes() == np.float32(cols["f32"][i]).tobytes()
    assert r["f64"].tobytes() == np.float64(cols["f64"][i]).tobytes()
    assert r["f16"].tobytes() == np.float16(cols["f16"][i]).tobytes()
    assert r["text"].item() == cols["text"][i].encode()  # "S<longest>"
    assert r["blob"] == cols["blob"][i]
    assert r["fixed"].dtype == np.uint8 and r["fixed"].tobytes() == cols["fixed"][i]
    assert r["vec"].shape == (4,) and r["vec"].tolist() == cols["vec"][i]
    assert r["mat"].shape == (2, 2) and r["mat"].dtype == np.int16
    assert r["mat"].tolist() == cols["mat"][i]
    assert [t.decode() for t in r["tags"].tolist()] == cols["tags"][i]
    assert r["maybe"] == (0 if cols["maybe"][i] is None else cols["maybe"][i])
    assert r["cat"].item() == cols["cat"][i].encode()
  config = (out / "elevator.toml").read_text()
  assert "not batchable" in config and "null rows" in config


def test_parquet_refuses_what_an_example_cannot_hold(tmp_path):
  from grain_elevator.tools.convert.parquet import ParquetSource  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table({"ok": [1], "when": pa.array([0], pa.timestamp("s"))}),
                 tmp_path / "a.parquet")
  with pytest.raises(ConvertError, match="column 'when' has type timestamp"):
    shards.convert(ParquetSource((str(tmp_path / "a.parquet"),)), str(tmp_path / "o"),
                   progress=False)
  pq.write_table(pa.table({"l": pa.array([[1, None]], pa.list_(pa.int64()))}),
                 tmp_path / "b.parquet")
  with pytest.raises(ConvertError, match="b.parquet: column 'l': row 0 holds a null inside a list"):
    shards.convert(ParquetSource((str(tmp_path / "b.parquet"),)), str(tmp_path / "o"),
                   progress=False)
  pq.write_table(pa.table({"ok": pa.array([1], pa.int32())}), tmp_path / "c1.parquet")
  pq.write_table(pa.table({"ok": pa.array([1.0])}), tmp_path / "c2.parquet")
  with pytest.raises(ConvertError, match="c2.parquet: its columns differ .*'ok'"):
    shards.convert(ParquetSource((str(tmp_path / "c*.parquet"),)), str(tmp_path / "o"),
                   progress=False)
  assert not (tmp_path / "o").exists()


def _npz_arrays(rng, n):
  return {
      "u8": rng.integers(0, 256, (n, 4, 3), dtype=np.uint8),
      "i8": rng.integers(-128, 128, (n,), dtype=np.int8),
      "f16": rng.standard_normal((n, 2)).astype(np.float16),
      "f64": rng.standard_normal(n),
      "big": rng.integers(0, 1000, (n, 2)).astype(">i4"),  # big-endian in the file
      "b": rng.integers(0, 2, n).astype(bool),
      "s": np.array([f"s{i}".encode() for i in range(n)], dtype="S4"),
      "u": np.array([f"ü{i}" for i in range(n)], dtype="<U4"),
      "c": (rng.standard_normal(n) + 1j).astype(np.complex64),
      "fort": np.asfortranarray(rng.standard_normal((n, 3)).astype(np.float32)),
  }


@pytest.mark.parametrize("workers,num_shards", [(1, 1), (2, 3)])
def test_npz_rows_come_back_bit_exact(tmp_path, workers, num_shards):
  from grain_elevator.tools.convert.npz import NpzSource  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  parts = [_npz_arrays(rng, n) for n in (50, 1, 77)]
  (tmp_path / "in").mkdir()
  np.savez(tmp_path / "in" / "a.npz", **parts[0])
  np.savez_compressed(tmp_path / "in" / "b.npz", **parts[1])
  np.savez(tmp_path / "in" / "c.npz", **parts[2])
  out = tmp_path / "out"
  summary = shards.convert(NpzSource((str(tmp_path / "in" / "*.npz"),)), str(out),
                           num_shards=num_shards, workers=workers, progress=False)
  assert summary.records == 128
  rows = parsed(out)
  for name in parts[0]:
    want = np.concatenate([p[name] for p in parts])
    got = np.stack([r[name] for r in rows])
    assert got.shape == want.shape and got.dtype == want.dtype.newbyteorder("<"), name
    assert got.tobytes() == want.astype(want.dtype.newbyteorder("<")).tobytes(), name


def test_npz_refusals(tmp_path):
  from grain_elevator.tools.convert.npz import NpzSource  # pylint: disable=g-import-not-at-top
  np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))
  np.savez(tmp_path / "ragged.npz", x=np.zeros(3), y=np.zeros(4))
  np.savez(tmp_path / "m1.npz", x=np.zeros((2, 3)))
  np.savez(tmp_path / "m2.npz", x=np.zeros((2, 4)))
  for pattern, match in [("obj.npz", "array 'x': dtype object is not supported"),
                         ("ragged.npz", "array 'y': 4 rows where"),
                         ("m*.npz", "m2.npz: array 'x' differs")]:
    with pytest.raises(ConvertError, match=match):
      shards.convert(NpzSource((str(tmp_path / pattern),)), str(tmp_path / "o"),
                     progress=False)
  assert not (tmp_path / "o").exists()


def test_served_by_a_real_server_as_in_embedded_mode(tmp_path, capsys):
  """`elevator convert npz`, then a server on the printed table (in this
  process: what `elevator serve` runs, started in a fraction of the time):
  the batches equal embedded mode's and the input's rows."""
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  from grain_elevator.server import Server, ServerOptions  # pylint: disable=g-import-not-at-top
  from helpers import assert_streams_equal  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  arrays = {"image": rng.integers(0, 256, (96, 8, 8), dtype=np.uint8),
            "label": rng.integers(0, 10, 96), "w": rng.standard_normal(96).astype(np.float16)}
  (tmp_path / "in").mkdir()
  np.savez(tmp_path / "in" / "x.npz", **arrays)
  assert cli.main(["convert", "npz", str(tmp_path / "in" / "*.npz"), str(tmp_path / "digits"),
                   "--shards", "3", "--quiet"]) == 0
  config = tmp_path / "printed.toml"
  config.write_text(capsys.readouterr().out)
  with Server(config, ServerOptions(port=0, workers=1)) as server:
    with RemoteDataset(server.target, "digits", 32) as remote:
      with RemoteDataset.embedded(str(config), "digits", 32, prefetch=0) as local:
        remote_batches = list(remote)
        assert assert_streams_equal(remote_batches, local) == 3
  rows = lambda images, labels, w: sorted(  # the epoch, shuffled: compare as sets
      (i.tobytes(), int(l), x.tobytes()) for i, l, x in zip(images, labels, w))
  got = [np.concatenate([b[k] for b in remote_batches]) for k in ("image", "label", "w")]
  assert rows(*got) == rows(arrays["image"], arrays["label"], arrays["w"])
