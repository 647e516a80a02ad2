"""`elevator bench --storage s3`'s text workload: the LLM input pipeline
(bench/text.py: JSON documents, BPE, chunks, first-fit packed rows) with
its documents in S3 (moto behind the fault proxy, buckets.py), a stream
dataset whose head reads by plan (server/data/streams/head_reads.py),
against, in one run, interleaved:

- the same server reading the same shards from local files;
- the server from the bucket with its reads by plan off (`--read-ahead-mb 0`);
- local Grain running the same pipeline over the bucket read record by
  record through file-like objects (bucket_sources.PerRecordSource, the FUSE
  pattern), with 16 read threads;
- the same over whole shards downloaded into a local cache holding half the
  data (bucket_sources.ShardCacheSource, Mosaic Streaming's pattern).

Reports tokens/s, the trainer's and the server's CPU, the server's read
amplification (its metrics), first-batch and resume latency.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any

from grain_elevator.tools.bench import buckets
from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images
from grain_elevator.tools.bench import text
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.storage_servers import free_port
from grain_elevator.tools.testing.launcher import LocalServer

# Documents: a corpus moto holds in memory, in shards of about a MiB (moto
# copies the object for every ranged GET).
DOCUMENTS = defaults.BUCKET_RECORDS["text"]
SHARDS = 16
FIGURES = ("tokens_per_s", "client_cores", "client_cpu_s_per_mtok", "server_cores",
           "server_cpu_s_per_mtok", "amplification", "first_batch_s", "resume_first_batch_s")


def _systems(w: text.TextWorkload, workers: int, servers: dict[str, LocalServer],
             urls: list[str], env: dict[str, str], tokenizer: str, cache: dict[str, Any]
             ) -> list[harness.System]:
  base = {"workload": w.name, "global_batch_size": w.global_batch_size, "pipeline": "text"}
  labels = {"local": f"service W={workers}, local files",
            "bucket": f"service W={workers}, bucket, reads by plan (default)",
            "bucket_noplan": f"service W={workers}, bucket, --read-ahead-mb 0"}
  out = [harness.System(key, labels[key], {
      **base, "system": "service", "dataset": w.name, "target": server.target, "client": {},
      "server_pids": [server.proc.pid]}, "service") for key, server in servers.items()]
  options = w.options
  options["options"]["tokenizer"] = tokenizer
  grain = {**base, "system": "grain", "files": [], "options": options,
           "threads": buckets.GRAIN_THREADS, "mp_workers": 0}
  out.append(harness.System(
      "grain_per_record", f"local Grain, per-record reads, {buckets.GRAIN_THREADS} threads", {
          **grain, "bucket_source": {"kind": "per_record", "urls": urls, "env": env}}, "grain"))
  out.append(harness.System(
      "grain_shard_cache", f"local Grain, whole shards, cache {buckets.CACHE_FRACTION:.0%} of "
      "data", {**grain, "bucket_source": {"kind": "shard_cache", "urls": urls, "env": env,
                                          **cache}}, "grain"))
  return out


def run_workload(root: pathlib.Path, *, workers: int, repeats: int, seconds: float,
                 warmup_s: float, latency_ms: float = buckets.DEFAULT_LATENCY_MS,
                 documents: int | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry.
  `global_batch_size`: rows a step instead of the workload's G (0: its own)."""
  w = workloads_lib.at_batch_size(text.WORKLOAD, global_batch_size)
  n = documents or DOCUMENTS
  data = root / "buckets"
  harness.log(f"[text/s3] preparing {n:,} documents in {SHARDS} shards in {data / w.name} ...")
  config, tokenizer = text.prepare(data, w, n, num_shards=SHARDS)
  files = sorted(os.fspath(p) for p in (data / w.name).glob("*.array_record"))
  workloads_lib.warm_page_cache(files)
  servers: dict[str, LocalServer] = {}
  with buckets.bucket_copy(w.name, files, latency_ms) as (proxy, urls, env), \
      tempfile.TemporaryDirectory(prefix="elevator-bench-cache-") as cache_root:
    cache = {"cache_root": cache_root, "limit_bytes": int(
        sum(os.path.getsize(f) for f in files) * buckets.CACHE_FRACTION)}
    bucket_config = str(buckets.bucket_config_of(config, w.name))
    ports = {"bucket": free_port(), "bucket_noplan": free_port()}
    try:
      servers["local"] = LocalServer(config, workers=workers)
      servers["bucket"] = LocalServer(bucket_config, workers=workers, env=env, extra_args=[
          "--metrics-port", str(ports["bucket"])])
      servers["bucket_noplan"] = LocalServer(bucket_config, workers=workers, env=env, extra_args=[
          "--read-ahead-mb", "0", "--metrics-port", str(ports["bucket_noplan"])])
      systems = _systems(w, workers, servers, urls, env, tokenizer, cache)
      pids = [s.proc.pid for s in servers.values()]
      marks: dict[str, Any] = {}

      def before() -> None:
        images.wait_idle(pids)
        marks.update({k: buckets.server_bytes(p) for k, p in ports.items()},
                     sent=proxy.stats.body_bytes, requests=proxy.stats.ranged_gets)

      def derive(s: harness.System, r: dict[str, Any]) -> dict[str, Any]:
        out = {**r, "amplification": None,
               "storage_requests": proxy.stats.ranged_gets - marks["requests"]}
        if s.key in ports:
          (needed0, fetched0, _), (needed, fetched, _) = (marks[s.key],
                                                          buckets.server_bytes(ports[s.key]))
          out["amplification"] = (fetched - fetched0) / max(1.0, needed - needed0)
        return out

      raw = harness.interleaved("text/s3", systems, repeats, seconds, warmup_s, before=before,
                                derive=derive, unit="tok/s", figure="tokens_per_s")
    finally:
      for server in servers.values():
        server.stop()
  return {"kind": "storage_text", "latency_ms": latency_ms, "documents": n, "shards": SHARDS,
          "shard_bytes": round(sum(os.path.getsize(f) for f in files) / len(files)),
          "length": w.length, "global_batch_size": w.global_batch_size, "workers": workers,
          "systems": harness.rows(systems, raw, FIGURES)}


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  rows = wl["systems"]
  local = rows["local"]["tokens_per_s"]["median"]
  lines = [f"### {name} from S3 (moto behind the proxy, {wl['latency_ms']:g} ms a request): "
           f"{wl['documents']:,} documents in {wl['shards']} shards of ~"
           f"{wl['shard_bytes'] / 2**20:.1f} MiB, rows of {wl['length']} tokens, "
           f"G={wl['global_batch_size']}; median (min–max) of {repeats} runs", "",
           "| system | tokens/s | × local files | trainer cores | trainer CPU s / M tokens | "
           "server cores | read amplification | first batch ms | resume ms |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows.values():
    f = lambda key, scale=1.0, digits=0: harness.fmt(r.get(key), scale, digits)  # noqa: E731
    lines.append(
        f"| {r['label']} | {f('tokens_per_s')} | {r['tokens_per_s']['median'] / local:.2f} | "
        f"{f('client_cores', digits=2)} | {f('client_cpu_s_per_mtok', digits=3)} | "
        f"{f('server_cores', digits=2)} | {f('amplification', digits=2)} | "
        f"{f('first_batch_s', 1e3)} | {f('resume_first_batch_s', 1e3)} |")
  bucket = rows["bucket"]["tokens_per_s"]["median"]
  grain = rows["grain_per_record"]["tokens_per_s"]["median"]
  return lines + ["", f"- from the bucket {bucket / local:.2f}× the same server from local "
                  f"files; {bucket / grain:.1f}× local Grain's per-record reads", ""]
