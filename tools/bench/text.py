"""`elevator bench`'s text workload: the LLM input pipeline, tokens in, packed
rows out.

Documents of CPython's reference manual (tools/text_corpus.py) stored as
JSON lines, tokenized with a byte-level BPE trained here
(tools/tokenizer.py), cut into chunks of at most LENGTH tokens (a flat_map),
packed first-fit into rows of exactly LENGTH tokens, G rows a step: the
stream dataset of pipelines/text.py, done two ways on the same records:

(a) local Grain on the trainer's own CPUs, at four settings of read threads
    and `mp_prefetch` processes (mp_prefetch packs per worker: its stream
    is not the one the others give, and its states cannot be resumed
    elsewhere);
(c) the service: `elevator serve` with its defaults and a default
    `RemoteDataset`, and with one worker.

Per system: tokens/s (text, not padding), the padding fraction, tokens/s per
core of the processes doing the work (the server's, or the trainer's for
local Grain), trainer CPU seconds per million tokens, the first batch, and
the first batch after resuming at a position about step 10^5.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import textwrap
from typing import Any

from grain_elevator.tools import text_corpus
from grain_elevator.tools import tokenizer as tokenizer_lib
from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images as images_bench
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

GRAIN_SETTINGS = images_bench.GRAIN_SETTINGS
FIGURES = ("tokens_per_s", "padding_fraction", "client_cpu_s_per_mtok",
           "server_cpu_s_per_mtok", "client_cores", "server_cores", "tokens_per_core_s",
           "first_batch_s", "resume_first_batch_s")


@dataclasses.dataclass(frozen=True)
class TextWorkload:
  name: str = "text"
  length: int = 512  # tokens per packed row, and per chunk
  global_batch_size: int = 32
  num_packing_bins: int = 32
  vocab_size: int = 4096
  default_records: int = defaults.RECORDS["text"]  # documents

  @property
  def options(self) -> dict[str, Any]:
    return {"options": {"tokenizer": "", "field": "text"},
            "iter_options": {"length": self.length,
                             "num_packing_bins": self.num_packing_bins}}


WORKLOAD = TextWorkload()


def prepare(root: pathlib.Path, w: TextWorkload, documents: int,
            num_shards: int = 8) -> tuple[str, str]:
  """Writes the documents and the tokenizer (unless present) and a config;
  returns (config path, tokenizer path)."""
  shards = root / w.name
  marker = shards / f".complete-{documents}"
  tokenizer = root / f"{w.name}-tokenizer-{w.vocab_size}.json"
  if not marker.exists():
    shards.mkdir(parents=True, exist_ok=True)
    for old in [*shards.glob("*.array_record"), *shards.glob(".complete-*")]:
      old.unlink()
    text_corpus.write_jsonl_shards(str(shards), documents, num_shards=num_shards, seed=0)
    marker.touch()
  if not tokenizer.exists():
    tokenizer_lib.train(tokenizer, w.vocab_size)
  config = root / f"{w.name}.toml"
  config.write_text(textwrap.dedent(f"""\
      [datasets.{w.name}]
      paths = ["{w.name}/*.array_record"]
      pipeline = "grain_elevator.pipelines.text:tokenize"
      iter_pipeline = "grain_elevator.pipelines.text:chunk_and_pack"
      seed = 1
      num_epochs = 0
      [datasets.{w.name}.options]
      tokenizer = "{tokenizer.name}"
      field = "text"
      [datasets.{w.name}.iter_options]
      length = {w.length}
      num_packing_bins = {w.num_packing_bins}
      """))
  return str(config), str(tokenizer)


def _systems(w: TextWorkload, files: list[str], tokenizer: str,
             servers: dict[str, LocalServer]) -> list[harness.System]:
  base = {"workload": w.name, "global_batch_size": w.global_batch_size, "pipeline": "text"}
  options = w.options
  options["options"]["tokenizer"] = tokenizer
  out = [harness.System(
      f"grain_t{threads}_mp{mp}", f"(a) local Grain, threads={threads}, mp_prefetch={mp}", {
          **base, "system": "grain", "files": files, "options": options, "threads": threads,
          "mp_workers": mp}, "grain") for threads, mp in GRAIN_SETTINGS]
  for key, server in servers.items():
    label = (f"(c) service, `elevator serve` defaults (W={os.cpu_count()}), default "
             "RemoteDataset" if key == "default" else "(c) service, W=1, default RemoteDataset")
    out.append(harness.System(f"service_{key}", label, {
        **base, "system": "service", "dataset": w.name, "target": server.target, "client": {},
        "server_pids": [server.proc.pid]}, "service"))
  return out


def _derived(s: harness.System, r: dict[str, Any]) -> dict[str, Any]:
  cores = r.get("server_cores") if s.kind == "service" else r.get("client_cores")
  return {**r, "tokens_per_core_s": r["tokens_per_s"] / cores if cores else None}


def run_workload(root: pathlib.Path, documents: int, *, workers: list[int], repeats: int,
                 seconds: float, warmup_s: float, global_batch_size: int = 0
                 ) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry.
  `global_batch_size`: rows a step instead of the workload's G (0: its own)."""
  del workers  # the service runs with `elevator serve`'s default and with one worker
  w = workloads_lib.at_batch_size(WORKLOAD, global_batch_size)
  harness.log(f"[{w.name}] preparing {documents:,} documents in {root / w.name} ...")
  config, tokenizer = prepare(root, w, documents)
  files = sorted(os.fspath(p) for p in (root / w.name).glob("*.array_record"))
  workloads_lib.warm_page_cache(files)
  servers: dict[str, LocalServer] = {}
  try:
    servers["default"] = LocalServer(config, workers=os.cpu_count() or 1)
    servers["w1"] = LocalServer(config, workers=1)
    systems = _systems(w, files, tokenizer, servers)
    pids = [s.proc.pid for s in servers.values()]
    raw = harness.interleaved(w.name, systems, repeats, seconds, warmup_s,
                              before=lambda: images_bench.wait_idle(pids), derive=_derived,
                              unit="tok/s", figure="tokens_per_s")
  finally:
    for server in servers.values():
      server.stop()
  return {"kind": "text", "length": w.length, "global_batch_size": w.global_batch_size,
          "num_packing_bins": w.num_packing_bins, "vocab_size": w.vocab_size,
          "documents": documents, "systems": harness.rows(systems, raw, FIGURES)}


def goals(wl: dict[str, Any]) -> list[str]:
  """Issue #28's three goals against the best local Grain, in words."""
  rows = wl["systems"]
  grain = [r for r in rows.values() if r["kind"] == "grain"]
  services = [r for r in rows.values() if r["kind"] == "service"]
  if not grain or not services:
    return []
  best = max(grain, key=lambda r: r["tokens_per_s"]["median"])
  cpu = best["client_cpu_s_per_mtok"]["median"]
  per_core = best["tokens_per_core_s"]["median"]
  out = [f"Best local Grain: {best['label'][4:]}: {best['tokens_per_s']['median']:,.0f} "
         f"tokens/s, {per_core:,.0f} tokens/s per trainer core, {cpu:.2f} trainer CPU s "
         "per million tokens."]
  for r in services:
    c = r["client_cpu_s_per_mtok"]["median"]
    p = (r["tokens_per_core_s"] or {}).get("median") or 0.0
    first = r["first_batch_s"]["median"]
    resume = (r["resume_first_batch_s"] or {}).get("median")
    resume_text = (f"{resume / first:.2f}× its first batch (goal ≤ 2: "
                   f"{'met' if resume <= 2 * first else 'not met'})") if resume else "n/a"
    out.append(f"{r['label'][4:]}: {harness.against_local('token', c, cpu, p, per_core)}; "
               f"resume at step 10⁵: {resume_text}.")
  return out


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  rows = wl["systems"]
  best = max((r for r in rows.values() if r["kind"] == "grain"),
             key=lambda r: r["tokens_per_s"]["median"])
  fmt = harness.fmt
  lines = [f"### {name}: documents → BPE ({wl['vocab_size']} tokens) → chunks → first-fit "
           f"packed rows of {wl['length']} tokens, G={wl['global_batch_size']}, "
           f"{wl['documents']:,} documents; median (min–max) of {repeats} runs", "",
           "| system | tokens/s | × best local Grain | padding | tokens/s per core (server's;"
           " local: trainer's) | trainer CPU s / M tokens | server CPU s / M tokens | first "
           "batch ms | resume @≈10⁵ ms |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows.values():
    ratio = r["tokens_per_s"]["median"] / best["tokens_per_s"]["median"]
    lines.append(
        f"| {r['label']} | {fmt(r['tokens_per_s'])} | {ratio:.2f} | "
        f"{fmt(r['padding_fraction'], 100, 1)}% | {fmt(r['tokens_per_core_s'])} | "
        f"{fmt(r['client_cpu_s_per_mtok'], digits=3)} | "
        f"{fmt(r['server_cpu_s_per_mtok'], digits=2)} | {fmt(r['first_batch_s'], 1e3)} | "
        f"{fmt(r['resume_first_batch_s'], 1e3)} |")
  notes = [
      "tokens: text tokens delivered (padding not counted); padding: the share of row "
      "slots that are padding (segment id 0).",
      "tokens/s per core: over the cores busy in the counted window: the server's "
      "processes where there is a server, the trainer's process and its mp_prefetch "
      "children for local Grain.",
      "resume: a new iterator set to a position about step 10⁵ (the head's index after 8 "
      "steps, scaled; with mp_prefetch, each worker's), to its first batch: a restore "
      "replays one packing window.",
      "mp_prefetch packs per worker: faster on this machine, not the same stream."]
  return lines + [""] + [f"- {g}" for g in goals(wl)] + [f"- {n}" for n in notes] + [""]
