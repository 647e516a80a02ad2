"""One builder for the tests' dataset configs: each kind of dataset the tests
serve is a function here, and a config is written from them, never as TOML
by hand.

    write_config(root / "elevator.toml",
                 aug=images(pipeline=AUGMENT, seed=7, num_epochs=2),
                 plain=images(shuffle=False),
                 mix=mixture(a=0.7, b=0.3),
                 lm=packed_text(seed=75))

Each function returns the dataset's table as plain values (the keys of
docs/datasets.md); keyword arguments add or replace keys, and `options` or
`iter_options` add to the kind's own. Paths are relative to the config
file unless absolute.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

import tomli_w

# The pipelines the tests name most (pipelines/examples.py, pipelines/text.py).
DECODE = "grain_elevator.pipelines.examples:decode_images"
AUGMENT = "grain_elevator.pipelines.examples:decode_and_augment"
DECODE_SOME = "grain_elevator.pipelines.examples:decode_some"  # a filter: a stream dataset
TOKENIZE = "grain_elevator.pipelines.text:tokenize"
PACK = "grain_elevator.pipelines.text:chunk_and_pack"
BATCH_AND_PAD = "grain.experimental:batch_and_pad"

# The conftest's image shards: 4x4x3 images (pipelines/examples.py).
IMAGE = {"height": 4, "width": 4, "channels": 3}
SHARDS = "shards/*.array_record"


def dataset(paths: str | os.PathLike[str] | list[Any] | None = SHARDS, **keys: Any
            ) -> dict[str, Any]:
  """A dataset's table: `paths` (a glob or a list of them; None for a
  dataset without shards: a mixture, a stream over one) and its keys."""
  table: dict[str, Any] = {}
  if paths is not None:
    table["paths"] = [str(p) for p in paths] if isinstance(paths, list) else [str(paths)]
  table.update({k: v for k, v in keys.items() if v is not None})
  return table


def _merged(own: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
  return {**own, **(extra or {})}


def images(paths: str | os.PathLike[str] | list[Any] | None = SHARDS, *,
           pipeline: str = DECODE, image: Mapping[str, int] = IMAGE,
           options: Mapping[str, Any] | None = None, **keys: Any) -> dict[str, Any]:
  """Image records decoded by `pipeline` (decode_images by default) at the
  conftest's image size unless `image` says another."""
  return dataset(paths, pipeline=pipeline, **keys, options=_merged(image, options))


def raw(paths: str | os.PathLike[str] | list[Any] | None = SHARDS, **keys: Any
        ) -> dict[str, Any]:
  """No pipeline: each record's bytes."""
  return dataset(paths, **keys)


def packed_text(paths: str | os.PathLike[str] | list[Any] | None = "text/*.array_record", *,
                tokenizer: str = "tokenizer.json", length: int = 32, bins: int = 4,
                options: Mapping[str, Any] | None = None,
                iter_options: Mapping[str, Any] | None = None, **keys: Any) -> dict[str, Any]:
  """Text for a language model: tokenized documents chunked and first-fit
  packed into rows of `length` tokens (a stream dataset)."""
  return dataset(paths, pipeline=TOKENIZE, iter_pipeline=PACK, **keys,
                 options=_merged({"tokenizer": tokenizer, "field": "text"}, options),
                 iter_options=_merged({"length": length, "num_packing_bins": bins},
                                      iter_options))


def mixture(**weights: float) -> dict[str, Any]:
  """A mixture of fixed weights over registered datasets, by name."""
  return {"mixture": dict(weights)}


def scheduled(schedule: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
  """A mixture whose weights change: {step: {dataset: weight}}."""
  return {"schedule": [{"step": step, "weights": dict(w)} for step, w in schedule.items()]}


def text_root(root: pathlib.Path, *, docs: int, seed: int = 3, vocab_size: int = 512,
              images: pathlib.Path | None = None) -> pathlib.Path:
  """`root` ready for `packed_text` datasets: text/ (`docs` synthetic
  documents in two shards), tokenizer.json trained on them and, given the
  conftest's data folder as `images`, shards/ linked to its image shards.
  Returns `root`."""
  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools import text_corpus
  from grain_elevator.tools import tokenizer as tokenizer_lib
  if images is not None:
    (root / "shards").symlink_to(images / "shards")
  text_corpus.write_jsonl_shards(str(root / "text"), docs, num_shards=2, seed=seed)
  tokenizer_lib.train(root / "tokenizer.json", vocab_size=vocab_size)
  return root


def config_text(**datasets: Mapping[str, Any]) -> str:
  """The TOML of a config serving these datasets, by name."""
  return tomli_w.dumps({"datasets": {name: dict(table) for name, table in datasets.items()}})


def write_config(path: str | os.PathLike[str], **datasets: Mapping[str, Any]) -> str:
  """Writes the config (its folder made if missing); returns its path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(config_text(**datasets))
  return str(path)
