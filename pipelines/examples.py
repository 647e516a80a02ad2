"""A small image dataset format and its pipelines, for the demo, tests and bench.

A record is fixed-size bytes: ``id:int64 | label:int64 | image:uint8[h*w*c]``.
`write_shards` writes any records as ArrayRecord shards (`write_image_shards`
a generated, learnable dataset of this format); the pipelines below are what
a config's ``pipeline = "..."`` names.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import grain
import numpy as np

from grain_elevator.pipelines import MIN_ROW_BYTES, RowStack

_HEADER = np.dtype([("id", "<i8"), ("label", "<i8")])
# batch_transform: records under this size are joined and read as one array
# (one Python call per batch); bigger ones are not copied at all: their pixels
# go out as views of the records (a RowStack), or are normalised row by row.
_JOIN_RECORD_BYTES = MIN_ROW_BYTES


def encode_record(record_id: int, label: int, image: np.ndarray) -> bytes:
  header = np.array([(record_id, label)], dtype=_HEADER)
  return header.tobytes() + np.ascontiguousarray(image, dtype=np.uint8).tobytes()


def decode_record(raw: bytes, height: int, width: int, channels: int) -> dict[str, Any]:
  header = np.frombuffer(raw, dtype=_HEADER, count=1)[0]
  image = np.frombuffer(raw, dtype=np.uint8, offset=_HEADER.itemsize)
  return {
      "id": np.int64(header["id"]),
      "label": np.int64(header["label"]),
      "image": image.reshape(height, width, channels),
  }


def write_shards(out_dir: str, num_records: int, record: Callable[[int], bytes], *,
                 num_shards: int, prefix: str = "train",
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
  """Writes records 0..num_records-1 (`record(i)`, called in order) as
  ArrayRecord shards `PREFIX-SSSSS-of-NNNNN.array_record` with ArrayRecord's
  default options, consecutive records to each shard; returns their paths.
  `progress(shards_done, num_shards)` is called after each shard."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  per_shard = -(-num_records // num_shards)
  for s in range(num_shards):
    path = os.path.join(out_dir, f"{prefix}-{s:05d}-of-{num_shards:05d}.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(s * per_shard, min((s + 1) * per_shard, num_records)):
      writer.write(record(i))
    writer.close()
    paths.append(path)
    if progress:
      progress(s + 1, num_shards)
  return paths


def write_image_shards(out_dir: str, *, num_records: int, num_shards: int,
                       height: int = 8, width: int = 8, channels: int = 1,
                       num_classes: int = 10, seed: int = 0,
                       prefix: str = "train") -> list[str]:
  """Writes a learnable labelled image dataset; returns the shard paths.

  Each class has a fixed random template; an image is its template plus noise,
  so a small model can learn it. Record ids run 0..num_records-1.
  """
  rng = np.random.default_rng(seed)
  templates = rng.integers(64, 192, size=(num_classes, height, width, channels))

  def record(i: int) -> bytes:
    label = int(rng.integers(num_classes))
    noise = rng.integers(-128, 129, size=templates[label].shape)
    image = np.clip(templates[label] + noise, 0, 255).astype(np.uint8)
    return encode_record(i, label, image)

  return write_shards(out_dir, num_records, record, num_shards=num_shards, prefix=prefix)


def decode_images(ds: grain.MapDataset, *, height: int, width: int,
                  channels: int = 1, normalize: bool = False) -> grain.MapDataset:
  """Pipeline: raw records -> {"id", "label", "image"} (uint8 or float32/255)."""
  ds = ds.map(functools.partial(decode_record, height=height, width=width,
                                channels=channels))
  if normalize:
    ds = ds.map(_normalize)
  return ds


def decode_images_batch(raw: list[bytes], *, height: int, width: int,
                        channels: int = 1, normalize: bool = False) -> dict[str, Any]:
  """batch_transform for `decode_images`: one numpy decode for a whole batch.

  Gives exactly `decode_images`' rows stacked (same dtypes, same float32
  arithmetic), which the server checks at start-up. Big raw images stay
  views of their records (a RowStack, stacked by the socket).
  """
  n = len(raw)
  shape = (height, width, channels)
  record = np.dtype([("head", _HEADER), ("image", np.uint8, shape)])
  bad = next((len(r) for r in raw if len(r) != record.itemsize), None)
  if bad is not None:
    raise ValueError(f"a record is {bad} bytes, expected {record.itemsize} for a "
                     f"{height}x{width}x{channels} image")
  if record.itemsize < _JOIN_RECORD_BYTES:  # small records: one join, then strided reads
    rows = np.frombuffer(b"".join(raw), dtype=record, count=n)
    header, pixels = rows["head"], rows["image"]
    image: Any = (np.divide(pixels, np.float32(255.0), dtype=np.float32) if normalize
                  else np.ascontiguousarray(pixels))
  else:  # big records: no joined intermediate, no stacking copy
    header = np.frombuffer(b"".join(r[:_HEADER.itemsize] for r in raw), dtype=_HEADER)
    views = [np.ndarray(shape, np.uint8, r, _HEADER.itemsize) for r in raw]
    if normalize:  # same float32 arithmetic as _normalize, straight into place
      image = np.empty((n, *shape), dtype=np.float32)
      for i, v in enumerate(views):
        np.divide(v, np.float32(255.0), out=image[i], dtype=np.float32)
    else:
      image = RowStack(views)
  return {"id": np.ascontiguousarray(header["id"]),
          "label": np.ascontiguousarray(header["label"]), "image": image}


def _normalize(record: dict[str, Any]) -> dict[str, Any]:
  return {**record, "image": record["image"].astype(np.float32) / 255.0}


def decode_and_augment(ds: grain.MapDataset, *, height: int, width: int,
                       channels: int = 1) -> grain.MapDataset:
  """Pipeline with a random transform: random horizontal flip plus a random
  per-record scalar; Grain seeds it per index, so it is reproducible."""
  ds = decode_images(ds, height=height, width=width, channels=channels)
  return ds.random_map(_flip_and_tag)


def _flip_and_tag(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
  image = record["image"]
  if rng.random() < 0.5:
    image = image[:, ::-1, :]
  return {**record, "image": np.ascontiguousarray(image),
          "noise": np.float32(rng.standard_normal())}


# -- stream pipelines: not 1:1, served as stream datasets (server/data/streams/stream.py) --


class _KeepLabels:
  """A filter's predicate; picklable."""

  def __init__(self, labels: list[int]):
    self.labels = frozenset(labels)

  def __call__(self, record: dict[str, Any]) -> bool:
    return int(record["label"]) in self.labels


def decode_some(ds: grain.MapDataset, *, height: int, width: int, channels: int = 1,
                labels: list[int]) -> grain.MapDataset:
  """`decode_images`, keeping only the records whose label is in `labels`
  (a filter: the dataset becomes a stream dataset)."""
  return decode_images(ds, height=height, width=width, channels=channels).filter(
      _KeepLabels(labels))


class _Rows(grain.experimental.FlatMapTransform):
  """An image's first label % height + 1 rows, one element each."""

  def __init__(self, height: int):
    self.max_fan_out = height

  def flat_map(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    image = record["image"]
    n = int(record["label"]) % len(image) + 1
    return [{"id": record["id"], "row": np.int32(r), "pixels": image[r]} for r in range(n)]


def decode_rows(ds: grain.MapDataset, *, height: int, width: int,
                channels: int = 1) -> grain.MapDataset:
  """`decode_images`, each image then split into some of its rows (a
  flat_map, 1 to `height` elements per record: a stream dataset)."""
  return grain.experimental.FlatMapMapDataset(
      decode_images(ds, height=height, width=width, channels=channels), _Rows(height))


def only_labels(ds: grain.MapDataset, *, labels: list[int]) -> grain.MapDataset:
  """Decoded records (a mixture's, say) whose label is in `labels`: a filter."""
  return ds.filter(_KeepLabels(labels))


def batch_centered(values: list[dict[str, Any]]) -> dict[str, np.ndarray]:
  """A batch function (Grain's `batch_fn`): the records stacked, their images
  as float32 less the batch's mean image."""
  out = {key: np.stack([v[key] for v in values]) for key in values[0]}
  images = out["image"].astype(np.float32)
  out["image"] = images - images.mean(axis=0, keepdims=True)
  return out
