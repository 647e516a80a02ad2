"""Text for language models: tokenize, chunk, pack (a stream dataset).

What a config names for the LLM workload (the form MaxText's Grain pipeline
takes: parse, tokenize, chunk with a flat_map, pack into fixed-length rows
with segment ids):

    [datasets.lm]
    paths = ["text/*.array_record"]     # `elevator convert jsonl` or `text` writes them
    pipeline = "grain_elevator.pipelines.text:tokenize"
    iter_pipeline = "grain_elevator.pipelines.text:chunk_and_pack"
    [datasets.lm.options]
    tokenizer = "tokenizer.json"        # a Hugging Face `tokenizers` file
    field = "text"                      # records are JSON lines; omit for plain text
    [datasets.lm.iter_options]
    length = 2048                       # tokens per row, and at most per chunk
    num_packing_bins = 64

A record is the bytes of a JSON object holding the text under `field`, or
the text itself (UTF-8). `tokenize` (random access, so the server computes
it on every worker at once) gives {"tokens": int32[n]}; empty documents
leave holes (a filter). `chunk_and_pack` cuts each document's tokens into
pieces of at most `length` (a flat_map on the IterDataset: a document is
tokenized once; a flat_map by index, FlatMapMapDataset, would compute its
document again for each of its max_fan_out slots), then packs them with
Grain's first-fit packing: rows of exactly `length` tokens with
"tokens_segment_ids" (0 is padding) and "tokens_positions". Every row has
the same shape, so the default batch function stacks them.

The tokenizer is a file the operator gives (every replica must have the same
one), loaded when the pipeline is built; the server records it at start-up
and refuses the dataset where it has changed since
(server/data/shards/option_files.py). `elevator make-tokenizer OUT.json`
trains a byte-level BPE locally from text that ships with CPython (its
pydoc topics), downloading nothing. The `tokenizers` package is the extra
``grain-elevator[text]``.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from typing import Any

import grain
import numpy as np

from grain_elevator.pipelines import ConfigError, config_path



def load_tokenizer(path: str) -> Any:
  """The tokenizer in a `tokenizers` JSON file, as the file is now (one
  load per process while the file stays the same)."""
  try:
    st = os.stat(path)
  except (OSError, ValueError):
    st = None
  if st is None or not stat.S_ISREG(st.st_mode):
    raise ConfigError(f"tokenizer file {path!r} does not exist (`elevator make-tokenizer "
                      f"{path}` trains one)")
  return _load(path, (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))


@functools.lru_cache(maxsize=8)
def _load(path: str, version: tuple[int, ...]) -> Any:
  """`version`: the file's stat, so a file replaced in this process (embedded
  mode, tests) is loaded anew rather than served from the cache."""
  del version
  try:
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError("the text pipelines need the `tokenizers` package: "
                      "pip install 'grain-elevator[text]'") from e
  try:
    return Tokenizer.from_file(path)
  except Exception as e:
    raise ConfigError(f"tokenizer file {path!r} is not a tokenizers JSON file: {e}") from e


class _Tokenize:
  """record bytes -> {"tokens": int32[n]} with the tokenizer loaded when the
  pipeline was built: the file is read then, never again while it serves
  (the server checks it then: server/data/shards/option_files.py).
  Picklable: it names its file, loaded again where it is unpickled."""

  def __init__(self, tokenizer: str, field: str | None):
    self.tokenizer, self.field = tokenizer, field
    self._loaded = load_tokenizer(tokenizer)

  def __getstate__(self) -> dict[str, Any]:
    return {"tokenizer": self.tokenizer, "field": self.field}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["tokenizer"], state["field"])

  def __call__(self, record: bytes) -> dict[str, np.ndarray]:
    if self.field is None:
      text = bytes(record).decode("utf-8")
    else:
      doc = json.loads(bytes(record))
      if not isinstance(doc, dict) or not isinstance(doc.get(self.field), str):
        raise ValueError(f"a record has no string field {self.field!r}")
      text = doc[self.field]
    ids = self._loaded.encode(text).ids
    return {"tokens": np.asarray(ids, dtype=np.int32)}


class _Chunk(grain.experimental.FlatMapTransform):
  """A document's tokens in pieces of at most `chunk_length`."""

  def __init__(self, chunk_length: int):
    self.chunk_length = chunk_length

  def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    tokens = element["tokens"]
    return [{"tokens": tokens[i:i + self.chunk_length]}
            for i in range(0, len(tokens), self.chunk_length)]


def _check_positive(name: str, value: Any) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
  return value


def tokenize(ds: grain.MapDataset, *, tokenizer: str, field: str | None = None
             ) -> grain.MapDataset:
  """Text records -> {"tokens": int32[n]}; empty documents filtered out.
  `tokenizer`: a tokenizers JSON file, relative to the config's folder."""
  # Loaded now: a bad path fails at start-up.
  return ds.map(_Tokenize(config_path(tokenizer), field)).filter(
      lambda e: len(e["tokens"]) > 0)


def chunk(ds: grain.IterDataset, *, length: int) -> grain.IterDataset:
  """Each document's tokens in pieces of at most `length`, in order."""
  _check_positive("length", length)
  return grain.experimental.FlatMapIterDataset(ds, _Chunk(length))


def pack(ds: grain.IterDataset, *, length: int, num_packing_bins: int, seed: int = 0,
         shuffle_bins: bool = False) -> grain.IterDataset:
  """Grain's first-fit packing of {"tokens": ...} into rows of `length`
  (chunk first: an element longer than `length` cannot be packed)."""
  _check_positive("length", length)
  _check_positive("num_packing_bins", num_packing_bins)
  return grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": length}, num_packing_bins=num_packing_bins, seed=seed,
      shuffle_bins=shuffle_bins)


def chunk_and_pack(ds: grain.IterDataset, *, length: int, num_packing_bins: int,
                   seed: int = 0, shuffle_bins: bool = False) -> grain.IterDataset:
  """`chunk`, then `pack`: tokenized documents into rows of exactly `length`."""
  return pack(chunk(ds, length=length), length=length, num_packing_bins=num_packing_bins,
              seed=seed, shuffle_bins=shuffle_bins)
