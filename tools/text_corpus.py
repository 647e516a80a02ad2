"""A text corpus made here from what ships with CPython, for the tests, the
demo and the benchmark's text workload: documents of paragraphs of the
reference manual (`pydoc_data.topics`, the tokenizer's own training text,
tools/tokenizer.py), drawn with a seed, so the same call gives the same
documents anywhere and nothing is downloaded.
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np


def paragraphs() -> list[str]:
  """Every non-blank paragraph of the pydoc topics, in a fixed order."""
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  out = []
  for name in sorted(topics):
    out += [p.strip() for p in topics[name].split("\n\n") if p.strip()]
  return out


def documents(count: int, *, seed: int = 0, max_paragraphs: int = 12) -> Iterator[str]:
  """`count` documents of 1 to `max_paragraphs` paragraphs each (about 100 to
  4,000 tokens); a few in a hundred are empty, as real corpora hold some."""
  rng = np.random.default_rng(seed)
  pool = paragraphs()
  for _ in range(count):
    if rng.random() < 0.02:
      yield ""
      continue
    picks = rng.integers(len(pool), size=int(rng.integers(1, max_paragraphs + 1)))
    yield "\n\n".join(pool[i] for i in picks)


def write_jsonl_shards(out_dir: str, count: int, *, num_shards: int, seed: int = 0,
                       field: str = "text") -> list[str]:
  """The documents as ArrayRecord shards of JSON lines ({field: text}, what
  `elevator convert jsonl` writes); returns the shard paths."""
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  docs = list(documents(count, seed=seed))
  return examples.write_shards(
      out_dir, count, lambda i: json.dumps({field: docs[i], "id": i}).encode(),
      num_shards=num_shards, prefix="text")
