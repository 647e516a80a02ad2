"""`elevator convert images`: label + exact file bytes, labels.txt, skipping."""

from __future__ import annotations

import io
import pathlib
import struct

import numpy as np
import pytest

from grain_elevator.tools import cli
from grain_elevator.tools.convert import images, shards
from grain_elevator.tools.convert.errors import ConvertError

PIL = pytest.importorskip("PIL.Image")

CLASSES = ["cat", "dog", "zebra fish"]


def _image(rng: np.random.Generator, fmt: str) -> bytes:
  pixels = rng.integers(0, 256, size=(int(rng.integers(4, 24)), int(rng.integers(4, 24)), 3),
                        dtype=np.uint8)
  out = io.BytesIO()
  PIL.fromarray(pixels).save(out, format=fmt)
  return out.getvalue()


def make_folder(root: pathlib.Path, per_class: int = 7) -> list[tuple[int, bytes]]:
  """A class-per-subfolder tree of real JPEG/PNG files (mixed-case
  extensions, a nested folder) plus files the converter must leave out;
  returns the expected (label, bytes) in record order."""
  rng = np.random.default_rng(0)
  expected = []
  for label, name in enumerate(CLASSES):
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    files = {}
    for i in range(per_class):
      fmt, ext = [("JPEG", ".jpg"), ("PNG", ".PNG"), ("JPEG", ".JPEG")][i % 3]
      rel = f"sub/img{i}{ext}" if i == 2 else f"img{i:02d}{ext}"
      data = _image(rng, fmt)
      (folder / rel).write_bytes(data)
      files[rel] = data
    expected += [(label, files[rel]) for rel in sorted(files)]
    (folder / "notes.txt").write_text("not an image")
    (folder / ".hidden.jpg").write_bytes(b"junk")
  (root / CLASSES[1] / "broken.jpg").write_bytes(b"GIF89a not really")
  (root / ".cache").mkdir()  # hidden: not a class
  return expected


def read_records(out: pathlib.Path) -> list[bytes]:
  from array_record.python.array_record_data_source import ArrayRecordDataSource  # pylint: disable=g-import-not-at-top
  source = ArrayRecordDataSource(sorted(str(p) for p in out.glob("*.array_record")))
  return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("workers,num_shards", [(1, 1), (2, 4)])
def test_labels_and_exact_file_bytes(tmp_path, workers, num_shards):
  expected = make_folder(tmp_path / "in")
  out = tmp_path / "out"
  summary = shards.convert(images.ImageFolderSource.of(str(tmp_path / "in")), str(out),
                           num_shards=num_shards, workers=workers, progress=False)
  assert summary.records == len(expected) == 21
  got = [(struct.unpack("<q", r[:8])[0], r[8:]) for r in read_records(out)]
  assert got == expected
  assert (out / "labels.txt").read_text() == "cat\ndog\nzebra fish\n"
  skipped = {pathlib.Path(p).name: why for p, why in summary.skipped}
  assert "not a JPEG or PNG" in skipped["broken.jpg"]
  assert "notes.txt" in skipped and ".hidden.jpg" not in skipped
  assert 'pipeline = "grain_elevator.pipelines.images:train_pipeline"' in summary.snippet
  assert "size = 224" in summary.snippet and "2=zebra fish" in summary.snippet


def test_the_same_bytes_whatever_the_workers(tmp_path):
  make_folder(tmp_path / "in", per_class=11)
  outs = []
  for workers in (1, 2):
    out = tmp_path / f"w{workers}" / "imgs"
    shards.convert(images.ImageFolderSource.of(str(tmp_path / "in")), str(out),
                   num_shards=5, workers=workers, progress=False)
    outs.append({p.name: p.read_bytes() for p in out.iterdir()})
  assert outs[0] == outs[1]


def test_strict_fails_on_a_non_image(tmp_path):
  make_folder(tmp_path / "in", per_class=2)
  with pytest.raises(ConvertError, match=r"broken\.jpg: not a JPEG or PNG file .*--strict"):
    shards.convert(images.ImageFolderSource.of(str(tmp_path / "in"), strict=True),
                   str(tmp_path / "out"), progress=False)
  assert not (tmp_path / "out").exists()


def test_cli(tmp_path, capsys):
  make_folder(tmp_path / "in", per_class=3)
  assert cli.main(["convert", "images", str(tmp_path / "in"), str(tmp_path / "pics"),
                   "--quiet", "--shards", "2"]) == 0
  captured = capsys.readouterr()
  assert "[datasets.pics]" in captured.out and "0=cat" in captured.out
  assert "skipped" in captured.err
  assert cli.main(["convert", "images", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
  assert "is not a folder" in capsys.readouterr().err


def test_the_record_format_is_the_one_tools_images_reads():
  """The converter's private encoder (used where pipelines/images.py cannot be
  imported, as in the Beam venv) writes what pipelines/images.py reads."""
  tools_images = pytest.importorskip("grain_elevator.pipelines.images")
  data = b"\xff\xd8\xff\xe0 some jpeg"
  for label in (0, 7, 2**40):
    record = images._encode_image_record(label, data)  # pylint: disable=protected-access
    assert record == tools_images.encode_image_record(label, data)
    got_label, got = tools_images.decode_image_record(record)
    assert got_label == label and bytes(got) == data


def test_no_classes(tmp_path):
  (tmp_path / "flat").mkdir()
  (tmp_path / "flat" / "a.jpg").write_bytes(b"\xff\xd8\xff")
  with pytest.raises(ConvertError, match="no class subfolders"):
    images.ImageFolderSource.of(str(tmp_path / "flat"))
