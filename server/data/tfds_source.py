"""TFDS datasets by name, read without TensorFlow.

A `[datasets.NAME]` table with `tfds = "mnist[:3.0.1]"`, `split` and
`data_dir` serves the records `tfds.data_source(name, split=, data_dir=)[i]`
would give: the split's ArrayRecord shards, read by the server's own batched
reader and decoded by TFDS's `features.deserialize_example_np`, the same call
TFDS makes per record. The source itself decodes (no extra `map` node), so a
config's `random_map` draws the same seeds as a pipeline applied on top of
`tfds.data_source`.

Resolved once, when the config is read: a bad name, version, split or
data_dir, a split not prepared, or a dataset stored as TFRecord refuses the
server's start with a ConfigError naming it. `tensorflow_datasets` is the
`[tfds]` extra; TensorFlow itself is never imported.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from grain_elevator.proto.errors import ConfigError, DataLossError
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.shards.identity import ShardIdentity


@dataclasses.dataclass(frozen=True)
class TfdsSplit:
  """A TFDS split as the server reads it: which records of which shards."""

  name: str  # as configured: "name[/config][:version]"
  split: str
  data_dir: str | None  # None: TFDS's default (TFDS_DATA_DIR or ~/tensorflow_datasets)
  dataset_dir: str  # the prepared version's folder: features.json, shards
  full_name: str  # "name/config/version", as the builder resolved it
  # (shard path, first record, end) in TFDS's order: record i of the split is
  # the i-th of their concatenation.
  instructions: tuple[tuple[str, int, int], ...]

  @property
  def files(self) -> tuple[str, ...]:
    return tuple(sorted({path for path, _, _ in self.instructions}))

  def fingerprint_fields(self) -> dict[str, Any]:
    return {"full_name": self.full_name, "split": self.split,
            "instructions": [[os.path.basename(p), a, b] for p, a, b in self.instructions]}


def _import_tfds(dataset: str) -> Any:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(
        f"dataset {dataset!r}: key 'tfds' needs tensorflow-datasets: "
        "pip install 'grain-elevator[tfds]' (TensorFlow is not needed)") from e
  return tfds


def resolve(dataset: str, name: str, split: str, data_dir: str | None) -> TfdsSplit:
  """Finds a prepared TFDS split on disk; every failure names what to fix."""
  tfds = _import_tfds(dataset)
  where = f"in data_dir {data_dir!r}" if data_dir else "in TFDS's default data_dir"
  if data_dir is not None and not os.path.isdir(data_dir):
    raise ConfigError(f"dataset {dataset!r}: key 'data_dir': {data_dir!r} is not a folder")
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # DatasetNotFoundError, bad version syntax, ...
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
        f"dataset {dataset!r}: TFDS dataset {name!r} not found {where}: "
        f"{first_line.rstrip('.')}{_versions_on_disk(data_dir, name)}") from e
  if not builder.is_prepared():
    raise ConfigError(
        f"dataset {dataset!r}: TFDS dataset {name!r} is not prepared {where} "
        f"(looked in {builder.data_dir}); build it with `tfds build "
        f"{name.split(':')[0]} --file_format=array_record"
        + (f" --data_dir={data_dir}`" if data_dir else "`"))
  formats = {str(getattr(f, "value", f)) for f in builder.info.available_file_formats()}
  if "array_record" not in formats:
    raise ConfigError(
        f"dataset {dataset!r}: TFDS dataset {name!r} {where} is stored as "
        f"{', '.join(sorted(formats)) or 'an unknown format'}, not ArrayRecord; "
        "rebuild it with `tfds build --file_format=array_record`, or convert its "
        "TFRecord files with `elevator convert tfrecord`")
  try:
    source = builder.as_data_source(split=split, file_format="array_record")
    from tensorflow_datasets.core.data_sources import base  # pylint: disable=g-import-not-at-top
    file_instructions = base.file_instructions(source.dataset_info, source.split)
  except Exception as e:  # unknown split, bad slice syntax
    raise ConfigError(
        f"dataset {dataset!r}: key 'split': {split!r} is not a split of TFDS "
        f"dataset {name!r}: {str(e).strip().splitlines()[0] if str(e).strip() else e}"
    ) from e
  instructions = tuple(
      (os.path.abspath(os.fspath(fi.filename)), int(fi.skip), int(fi.skip) + int(fi.take))
      for fi in file_instructions if int(fi.take) > 0)
  if not instructions:
    raise ConfigError(f"dataset {dataset!r}: TFDS split {split!r} of {name!r} holds no records")
  return TfdsSplit(name=name, split=split, data_dir=data_dir,
                   dataset_dir=os.fspath(builder.data_dir),
                   full_name=builder.info.full_name, instructions=instructions)


def _versions_on_disk(data_dir: str | None, name: str) -> str:
  """"; versions on disk: 1.0.0, 1.1.0" where the dataset's folder exists."""
  base = name.split(":")[0]
  folder = os.path.join(data_dir, base) if data_dir else None
  if not folder or not os.path.isdir(folder):
    return ""
  versions = sorted(v for v in os.listdir(folder)
                    if os.path.isfile(os.path.join(folder, v, "dataset_info.json")))
  return f"; versions on disk: {', '.join(versions) or 'none'}"


def _features(split: TfdsSplit) -> Any:
  tfds = _import_tfds(split.name)
  return tfds.features.FeaturesDict.from_config(split.dataset_dir)


class TfdsSource(BatchedArrayRecordSource):
  """The split's records, decoded: `tfds.data_source(...)[i]` for each key.

  Reads through the server's batched shard reader (one call per shard of a
  batch, identities checked), then decodes each serialized Example with
  TFDS's own `deserialize_example_np`.
  """

  def __init__(self, split: TfdsSplit, *,
               identities: Mapping[str, ShardIdentity | None] | None = None):
    # ArrayRecord's "path[start:end]" form: a slice of a shard, as TFDS's
    # file instructions name it.
    super().__init__([f"{path}[{start}:{end}]" for path, start, end in split.instructions],
                     identities=identities)
    self._tfds_split = split
    self._decode = _features(split).deserialize_example_np

  def __getstate__(self):
    state = super().__getstate__()
    del state["_decode"]  # rebuilt from features.json
    return state

  def __setstate__(self, state):
    super().__setstate__(state)
    self._decode = _features(self._tfds_split).deserialize_example_np

  def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
    decode = self._decode
    out = []
    for key, raw in zip(indices, self.read_raw(indices)):
      try:
        out.append(decode(raw))
      except Exception as e:  # pylint: disable=broad-except
        raise DataLossError(
            f"{self.where(key)} is not an Example of TFDS dataset "
            f"{self._tfds_split.name!r} that TFDS can decode: {type(e).__name__}: {e}") from e
    return out

  def __repr__(self) -> str:
    return (f"TfdsSource(name={self._tfds_split.name!r}, split={self._tfds_split.split!r}, "
            f"records={len(self)})")


class _BatchDecoder:
  """Decodes a batch of serialized Examples straight into stacked arrays:
  one protobuf parse per record, then one numpy array per numeric feature
  for the whole batch, and images decoded into place by TFDS's own image
  decode. What TFDS's per-record `deserialize_example_np` gives, stacked
  (ElevatorDataset checks that at start-up), without its per-record tree
  walks."""

  def __init__(self, plan: list[tuple[str, str, np.dtype, tuple[int, ...], Any]]):
    from tensorflow_datasets.proto import tf_example_pb2  # pylint: disable=g-import-not-at-top
    self._parse = tf_example_pb2.Example.FromString
    self._plan = plan

  def __repr__(self) -> str:
    return f"<TFDS batch decoder of {', '.join(k for k, *_ in self._plan)}>"

  def __call__(self, raw: Sequence[bytes]) -> dict[str, np.ndarray]:
    maps = [self._parse(r).features.feature for r in raw]
    out = {}
    for key, kind, dtype, shape, decode_image in self._plan:
      if kind == "image":
        image = np.empty((len(maps), *shape), dtype)
        for i, m in enumerate(maps):
          image[i] = decode_image(m[key].bytes_list.value[0])
        out[key] = image
      elif shape:
        size = int(np.prod(shape))
        values = [getattr(m[key], kind).value for m in maps]
        if any(len(v) != size for v in values):
          raise ValueError(f"feature {key!r}: a record holds another number of values "
                           f"than its shape {list(shape)}")
        out[key] = np.array(values, dtype).reshape((len(maps), *shape))
      else:  # scalars: TFDS gives Python scalars (`.item()`), stacked as numpy does
        values = np.array([getattr(m[key], kind).value[0] for m in maps], dtype)
        out[key] = values.astype(np.asarray(np.zeros((), dtype).item()).dtype)
    return out


def batch_decoder(split: TfdsSplit) -> Callable[[Sequence[bytes]], dict[str, Any]] | None:
  """A whole-batch decoder for the split's features, or None where they are
  not all fixed-shape numeric tensors, class labels and images."""
  tfds = _import_tfds(split.name)
  features = _features(split)
  plan = []
  for key, feature in sorted(features.items()):
    info = feature.get_tensor_info()
    if info.shape is None or any(d is None for d in info.shape):
      return None
    dtype = np.dtype(info.np_dtype)
    if isinstance(feature, tfds.features.Image) and type(feature) is tfds.features.Image:
      if dtype != np.uint8:
        return None
      plan.append((key, "image", dtype, tuple(info.shape), feature.decode_example_np))
      continue
    if type(feature) not in (tfds.features.Tensor, tfds.features.ClassLabel, tfds.features.Scalar):
      return None
    serialized = feature.get_serialized_info()
    if serialized.shape != info.shape or np.dtype(serialized.np_dtype) != dtype:
      return None  # stored encoded (bytes, zlib): leave it to TFDS
    if dtype.kind in "iub" and dtype != np.uint64:  # TFDS stores uint64 bit-cast
      kind = "int64_list"
    elif dtype.kind == "f":
      kind = "float_list"
    else:
      return None
    plan.append((key, kind, dtype, tuple(info.shape), None))
  return _BatchDecoder(plan) if plan else None
