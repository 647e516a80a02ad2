"""The benchmark's two workloads, written as ArrayRecord shards with a config.

small: 3,088 B records (16 B id/label header + 32x32x3 uint8 image), decoded
       per record to float32/255 as a user writes it, G=256.
large: 150 KiB incompressible images (160x320x3 uint8), G=32 (~4.9 MB batches).
image: ImageNet-like JPEGs (~500x375, ~114 KB at quality 90) in pipelines/images.py's
       record format, through its train_pipeline (decode, random resized crop to
       224x224, flip), G=64 (9.6 MB batches of uint8 pixels).
costly: 1,024 B records (16 B header + 12x28x3 uint8), each costing its worker
       costly.WORK_US_PER_RECORD of CPU (tools/bench/costly.py), G=64: 64 KiB steps.
All repeat forever, so any step (10^6 included) exists.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import textwrap
from typing import TypeVar

import numpy as np

from grain_elevator.pipelines import examples
from grain_elevator.tools.bench import costly
from grain_elevator.tools.bench import defaults


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  height: int
  width: int
  channels: int
  normalize: bool
  global_batch_size: int
  default_records: int
  # "pixels": examples.py's fixed-size records; "image": pipelines/images.py's
  # encoded images, height x width being the pipeline's output size.
  kind: str = "pixels"
  # CPU microseconds a pixels record's pipeline spends beyond its decode
  # (tools/bench/costly.py); 0: examples.py's decode alone.
  work_us_per_record: int = 0

  @property
  def record_bytes(self) -> int:
    """Bytes of one stored record (the image kind: on average)."""
    if self.kind == "image":
      return 8 + IMAGE_JPEG_BYTES
    return 16 + self.height * self.width * self.channels

  @property
  def options(self) -> dict[str, object]:
    if self.kind == "image":
      return {"size": self.height}
    return {"height": self.height, "width": self.width, "channels": self.channels,
            "normalize": self.normalize}

  @property
  def pipeline(self) -> tuple[str, str]:
    """A pixels workload's server pipeline and batch_transform."""
    if self.work_us_per_record:
      return ("grain_elevator.tools.bench.costly:pixels",
              "grain_elevator.tools.bench.costly:pixels_batch")
    return ("grain_elevator.pipelines.examples:decode_images",
            "grain_elevator.pipelines.examples:decode_images_batch")

  @property
  def pipeline_options(self) -> dict[str, object]:
    """`options`, and the work a costly pipeline takes."""
    if self.work_us_per_record:
      return {**self.options, "work_us_per_record": self.work_us_per_record}
    return self.options

  @property
  def delivered_bytes_per_record(self) -> int:
    """Bytes of one decoded record as the trainer receives it."""
    if self.kind == "image":
      return 8 + self.height * self.width * self.channels
    pixel = 4 if self.normalize else 1
    return 16 + self.height * self.width * self.channels * pixel


W = TypeVar("W")  # a workload: Workload, or text.py's TextWorkload

IMAGE_JPEG_BYTES = 114_000  # images.synthetic_jpeg's files, on average
IMAGE_CLASSES = 1000

WORKLOADS = {
    "small": Workload("small", 32, 32, 3, True, 256, defaults.RECORDS["small"]),
    "large": Workload("large", 160, 320, 3, False, 32, defaults.RECORDS["large"]),
    "image": Workload("image", 224, 224, 3, False, 64, defaults.RECORDS["image"],
                      kind="image"),
    "costly": Workload("costly", 12, 28, 3, False, 64, costly.RECORDS,
                       work_us_per_record=costly.WORK_US_PER_RECORD),
}


def at_batch_size(w: W, global_batch_size: int) -> W:
  """`w` with another G (`elevator bench --global-batch-size`, for a smoke
  run that checks every system without paying for full-size steps); `w`
  itself when `global_batch_size` is 0."""
  return dataclasses.replace(w, global_batch_size=global_batch_size) if global_batch_size else w


def prepare(root: pathlib.Path, w: Workload, num_records: int, num_shards: int = 8,
            progress=None) -> str:
  """Writes shards (unless present) and a config; returns the config path."""
  shards = root / w.name
  marker = shards / f".complete-{num_records}"
  if not marker.exists():
    shards.mkdir(parents=True, exist_ok=True)
    for old in [*shards.glob("*.array_record"), *shards.glob(".complete-*")]:
      old.unlink()
    rng = np.random.default_rng(0)
    if w.kind == "image":
      from grain_elevator.pipelines import images  # pylint: disable=g-import-not-at-top
      record = functools.partial(images.synthetic_record, classes=IMAGE_CLASSES, seed=0)
    else:
      record = lambda i: examples.encode_record(  # noqa: E731
          i, i % 10, rng.integers(0, 256, size=(w.height, w.width, w.channels),
                                  dtype=np.uint8))
    examples.write_shards(str(shards), num_records, record, num_shards=num_shards,
                          prefix=w.name, progress=progress)
    marker.touch()
  config = root / f"{w.name}.toml"
  if w.kind == "image":
    config.write_text(textwrap.dedent(f"""\
        [datasets.{w.name}]
        paths = ["{w.name}/*.array_record"]
        pipeline = "grain_elevator.pipelines.images:train_pipeline"
        seed = 1
        num_epochs = 0
        [datasets.{w.name}.options]
        size = {w.height}
        """))
    return str(config)
  opts = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}"
                   for k, v in w.pipeline_options.items())
  pipeline, batch_transform = w.pipeline
  body = textwrap.dedent(f"""\
      [datasets.{w.name}]
      paths = ["{w.name}/*.array_record"]
      pipeline = "{pipeline}"
      batch_transform = "{batch_transform}"
      seed = 1
      num_epochs = 0
      [datasets.{w.name}.options]
      """) + opts + "\n"
  body += textwrap.dedent(f"""
      [datasets.{w.name}_per_record]
      paths = ["{w.name}/*.array_record"]
      pipeline = "{pipeline}"
      seed = 1
      num_epochs = 0
      [datasets.{w.name}_per_record.options]
      """) + opts + "\n"
  config.write_text(body)
  return str(config)


def shard_files(root: pathlib.Path, w: Workload) -> list[str]:
  return sorted(os.fspath(p) for p in (root / w.name).glob("*.array_record"))


def warm_page_cache(files: list[str]) -> None:
  """Reads every shard once, so no system pays for a cold cache the next didn't."""
  for path in files:
    with open(path, "rb") as f:
      while f.read(8 << 20):
        pass
