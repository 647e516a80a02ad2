"""A TFDS dataset written without TensorFlow, for the demo, tests and bench.

`write_tfds_dataset` prepares labelled images as a real TFDS dataset in
ArrayRecord format (dataset_info.json, features.json, one shard set per
split), exactly what `tfds build --file_format=array_record` leaves behind,
so `tfds.data_source(name, data_dir=...)` and a config's `tfds = "..."` read
it. Its features: `image` (PNG-encoded uint8 HxWxC), `label` (ClassLabel),
`id` (int64, the record's position in the arrays given).

`augment` is a pipeline for such records: a random horizontal flip per index.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import grain
import numpy as np


def write_tfds_dataset(data_dir: str, name: str, splits: dict[str, tuple[np.ndarray, np.ndarray]],
                       *, num_classes: int, version: str = "1.0.0",
                       shards_per_split: int = 1) -> str:
  """Prepares `name` under `data_dir`; `splits` maps a split name to
  (images uint8 [N,H,W,C], labels int [N]). Returns the version's folder.

  Needs `tensorflow-datasets` and Pillow (the `[tfds]` extra), not TensorFlow.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  shape = next(iter(splits.values()))[0].shape[1:]

  def pil(image: np.ndarray) -> Any:
    return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)

  tfds.disable_progress_bar()
  with tfds.core.registered.skip_registration():

    class _Builder(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version(version)
      code_path = None  # no source folder of its own (TFDS would look in ours)

      def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description="Labelled images written by grain_elevator.tools.tfds_example.",
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=shape),
                "label": tfds.features.ClassLabel(num_classes=num_classes),
                "id": np.int64,
            }))

      def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(split) for split in splits}

      def _generate_examples(self, split: str = "train"):
        images, labels = splits[split]
        for i, (image, label) in enumerate(zip(images, labels)):
          yield i, {"image": pil(image), "label": int(label), "id": i}

    _Builder.name = name
    builder = _Builder(data_dir=data_dir, file_format="array_record")
    with contextlib.redirect_stdout(io.StringIO()):  # TFDS's "Downloading..." lines
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
          num_shards=shards_per_split))
  return str(builder.data_dir)


def augment(ds: grain.MapDataset) -> grain.MapDataset:
  """Pipeline: flips each record's `image` left-right with probability 1/2,
  drawn per index (Grain's `random_map`), so any replica draws the same."""
  return ds.random_map(_flip)


def _flip(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
  if rng.random() < 0.5:
    return {**record, "image": np.ascontiguousarray(record["image"][:, ::-1])}
  return record
