"""The Beam pipeline (DirectRunner, in .venv-beam) writes byte for byte what
`elevator convert` writes, for every format; and fails like it."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert.images import ImageFolderSource
from grain_elevator.tools.convert.npz import NpzSource
from grain_elevator.tools.convert.tfrecord import TFRecordSource
from helpers import beam_python as _beam_python
from helpers import run_beam



@pytest.fixture(autouse=True)
def _beam_temp_in_tmp_path(tmp_path, monkeypatch):
  """The DirectRunner leaves beam-temp-* folders in $TMPDIR: keep them in the test's."""
  (tmp_path / "beam-tmp").mkdir()
  monkeypatch.setenv("TMPDIR", str(tmp_path / "beam-tmp"))


def files(folder: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _inputs(tmp_path: pathlib.Path, kind: str):
  """(CLI arguments naming the input, the local Source) for one format."""
  folder = tmp_path / "in"
  folder.mkdir()
  rng = np.random.default_rng(0)
  if kind == "tfrecord":
    from test_convert_tfrecord import write_tfrecord  # pylint: disable=g-import-not-at-top
    for i in range(3):
      write_tfrecord(folder / f"p{i}.tfrecord",
                     [rng.bytes(int(rng.integers(0, 200))) for _ in range(40 + 7 * i)])
    return [str(folder / "*.tfrecord")], TFRecordSource((str(folder / "*.tfrecord"),))
  if kind == "images":
    from test_convert_images import make_folder  # pylint: disable=g-import-not-at-top
    make_folder(folder, per_class=5)
    return [str(folder)], ImageFolderSource.of(str(folder))
  if kind == "parquet":
    pq = pytest.importorskip("pyarrow.parquet")
    from grain_elevator.tools.convert.parquet import ParquetSource  # pylint: disable=g-import-not-at-top
    from test_convert_columns import _table  # pylint: disable=g-import-not-at-top
    for i, n in enumerate((60, 45)):
      pq.write_table(_table(rng, 100 * i, n), folder / f"p{i}.parquet", row_group_size=25)
    return [str(folder / "*.parquet")], ParquetSource((str(folder / "*.parquet"),))
  from test_convert_columns import _npz_arrays  # pylint: disable=g-import-not-at-top
  for i, n in enumerate((30, 21)):
    np.savez(folder / f"p{i}.npz", **_npz_arrays(rng, n))
  return [str(folder / "*.npz")], NpzSource((str(folder / "*.npz"),))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tfrecord", "images", "parquet", "npz"])
def test_beam_output_is_byte_identical_to_the_local_converter(tmp_path, kind):
  _beam_python()
  args, source = _inputs(tmp_path, kind)
  local = tmp_path / "local" / "data"
  shards.convert(source, str(local), num_shards=3, workers=2, progress=False)
  beam = tmp_path / "beam" / "data"
  done = run_beam(kind, *args, str(beam), "--shards", "3")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "[datasets.data]" in done.stdout
  want = files(local)
  assert sum(n.endswith(".array_record") for n in want) == 3
  assert files(beam) == want
  assert not [p for p in beam.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_beam_fails_like_the_local_converter(tmp_path):
  _beam_python()
  args, _ = _inputs(tmp_path, "tfrecord")
  bad = tmp_path / "in" / "p2.tfrecord"
  data = bytearray(bad.read_bytes())
  data[1] ^= 0x10  # the first record's length
  bad.write_bytes(bytes(data))
  out = tmp_path / "out"
  done = run_beam("tfrecord", *args, str(out))
  assert done.returncode == 2, done.stderr[-3000:]
  assert f"elevator: error: {bad}: at byte 0: the record length fails its CRC" in done.stderr
  assert not out.exists() and not list(tmp_path.glob(".out.*"))
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "x.array_record").write_bytes(b"")
  bad.write_bytes(b"")
  done = run_beam("tfrecord", *args, str(tmp_path / "taken"))
  assert done.returncode == 2 and "--overwrite" in done.stderr
