"""`elevator bench --storage s3`'s text workload: the LLM input pipeline
(bench/text.py: JSON documents, BPE, chunks, first-fit packed rows) with
its documents in the stand-in S3 store (buckets.py), a stream dataset whose
head reads by plan (server/data/streams/head_reads.py), against the same
systems as the other workloads, interleaved (buckets.py's docstring): the
server by plan, with its cache cold and warm, local Grain running the same
pipeline over per-record reads (the FUSE pattern) and over whole shards in
a windowed shuffle (the Mosaic/LitData pattern), and the server on local
files.

Tokens/s is the figure. Per-document figures (GETs, read amplification, the
GET cost per TB) count the documents a window's tokens came from: its
tokens ÷ the mean tokens of a document (tokenized from a sample of the
corpus at start).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from grain_elevator.tools.bench import buckets
from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import text
from grain_elevator.tools.bench import workloads as workloads_lib

DOCUMENTS = defaults.BUCKET_RECORDS["text"]
# ~690 B a document stored: 100,000 documents are ~69 MB, in MIN_SHARDS shards.
DOCUMENT_BYTES = 690
# Documents tokenized at start to learn the mean tokens of one.
SAMPLE = 2_000


def tokens_per_document(files: list[str], tokenizer: str, sample: int = SAMPLE) -> float:
  """The mean tokens of a document, as the pipeline tokenizes it (`sample`
  documents spread over the shards)."""
  import grain  # pylint: disable=g-import-not-at-top
  from grain_elevator.pipelines import text as text_pipeline  # pylint: disable=g-import-not-at-top
  source = grain.sources.ArrayRecordDataSource(files)
  tokenize = text_pipeline._Tokenize(tokenizer, "text")  # pylint: disable=protected-access
  n = len(source)
  keys = range(0, n, max(1, n // sample))
  counts = [len(tokenize(source[k])["tokens"]) for k in keys]
  return sum(counts) / max(1, len(counts))


def setup_of(root: pathlib.Path, workers: int, documents: int | None = None,
             global_batch_size: int = 0) -> buckets.Setup:
  """The text workload written (unless it is) in shards of ~SHARD_BYTES."""
  del workers  # the text client's settings are its defaults
  w = workloads_lib.at_batch_size(text.WORKLOAD, global_batch_size)
  n = documents or DOCUMENTS
  data = root / "buckets"
  shards = buckets.shard_count(n, DOCUMENT_BYTES)
  harness.log(f"[text/s3] preparing {n:,} documents in {shards} shards in {data / w.name} ...")
  folder = data / w.name
  if len(list(folder.glob("*.array_record"))) != shards:  # written for another count
    for marker in folder.glob(".complete-*"):
      marker.unlink()
  config, tokenizer = text.prepare(data, w, n, num_shards=shards)
  files = sorted(os.fspath(p) for p in folder.glob("*.array_record"))
  base = {"workload": w.name, "global_batch_size": w.global_batch_size, "pipeline": "text"}
  options = w.options
  options["options"]["tokenizer"] = tokenizer
  return buckets.Setup(
      name=w.name, text=True, config=config, files=files,
      global_batch_size=w.global_batch_size,
      service={**base, "system": "service", "dataset": w.name, "client": {}},
      grain={**base, "system": "grain", "files": [], "options": options,
             "threads": buckets.GRAIN_THREADS, "mp_workers": 0},
      tokens_per_record=tokens_per_document(files, tokenizer))


def run_workload(root: pathlib.Path, *, workers: int, repeats: int, seconds: float,
                 warmup_s: float, settings: buckets.StoreSettings = buckets.StoreSettings(),
                 documents: int | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry.
  `global_batch_size`: rows a step instead of the workload's G (0: its own)."""
  setup = setup_of(root, workers, documents, global_batch_size)
  entry = buckets.run_setup(setup, root, workers=workers, repeats=repeats, seconds=seconds,
                            warmup_s=warmup_s, settings=settings)
  entry["length"] = text.WORKLOAD.length
  return entry


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  return buckets.table(name, wl, repeats)
