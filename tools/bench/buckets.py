"""`elevator bench --storage s3`: the small and image workloads (and text,
bucket_text.py) read from an S3 server (moto, storage_servers.py) behind the fault proxy at
`--storage-latency-ms` (20) a request, against, in one run:

- the same server reading the same shards from local files;
- the server from the bucket with its reads by plan off (`--read-ahead-mb 0`):
  what the plan is worth;
- local Grain reading the bucket record by record through file-like
  objects, as over a FUSE mount (bucket_sources.PerRecordSource), with 16
  read threads;
- local Grain over whole shards downloaded into a bounded local cache, half
  the dataset (bucket_sources.ShardCacheSource, Mosaic Streaming's pattern).

Each run reports records/s, the trainer's CPU, the server's cores, the read
amplification, and first-batch and resume latency. Read amplification is
bytes fetched ÷ the stored bytes of the records read. For a server, from
its metrics over the run: `elevator_storage_fetched_bytes_total` ÷
`elevator_storage_needed_bytes_total`, which counts every step it made,
those in the client's window included (plans for steps not made when the
run ends count as fetched: short runs overstate it). For local Grain: the bytes
the proxy sent ÷ the records the trainer pulled (bench/consume.py's
`records_total`). moto runs on the same cores as everything
else, and costs CPU per request: the notes say how much.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import time
from typing import Any, Iterator

from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images
from grain_elevator.tools.bench import run as run_lib
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.fault_proxy import FaultProxy
from grain_elevator.tools import top
from grain_elevator.tools.testing.storage_servers import S3Server, free_port
from grain_elevator.tools.testing.launcher import LocalServer

BUCKET = "elevator-bench"
DEFAULT_LATENCY_MS = defaults.BUCKET_LATENCY_MS
# moto copies each object it serves a range of (~1.5 ms a MiB here), so the
# bench's shards are small, unlike a real bucket's (100 MB-1 GB).
SHARD_BYTES = 1 << 20
RECORDS = defaults.BUCKET_RECORDS  # per workload
GRAIN_THREADS = 16
# The whole-shard cache holds this fraction of the dataset.
CACHE_FRACTION = 0.5
WORKLOADS = ("small", "image", "text")  # text: bucket_text.py


def _client(w: workloads_lib.Workload, workers: int) -> dict[str, Any]:
  if w.kind == "image":
    return images.client_settings(workers)
  return run_lib.client_settings(w, workers)


@contextlib.contextmanager
def bucket_copy(name: str, files: list[str], latency_ms: float
                ) -> Iterator[tuple[FaultProxy, list[str], dict[str, str]]]:
  """moto holding `files` under s3://BUCKET/NAME/, behind the proxy at
  `latency_ms` a request: (the proxy, the objects' URLs, the environment
  that reaches them)."""
  with S3Server() as s3, FaultProxy(s3.url, latency_s=latency_ms / 1000) as proxy:
    s3.create_bucket(BUCKET)
    for f in files:
      s3.put(BUCKET, f"{name}/{os.path.basename(f)}", pathlib.Path(f).read_bytes())
    yield proxy, [f"s3://{BUCKET}/{name}/{os.path.basename(f)}" for f in files], s3.env(proxy.url)


def bucket_config_of(config: str, name: str) -> pathlib.Path:
  """A copy of the workload's config beside it whose paths are the bucket's."""
  text = pathlib.Path(config).read_text().replace(
      f'paths = ["{name}/*.array_record"]', f'paths = ["s3://{BUCKET}/{name}/*.array_record"]')
  path = pathlib.Path(config).parent / f"{name}-s3.toml"
  path.write_text(text)
  return path


def stored_bytes(urls: list[str], env: dict[str, str]) -> tuple[int, int]:
  """(records, bytes of their chunks) of the shards at `urls`."""
  from grain_elevator.server.data.object_source import ObjectRecordSource  # pylint: disable=g-import-not-at-top
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    readers = ObjectRecordSource(urls)._readers  # pylint: disable=protected-access
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  records = sum(r.num_records for r in readers)
  return records, sum(b - a for r in readers for a, b in r.extents(range(r.num_records)))


def server_bytes(port: int) -> tuple[float, float, float]:
  """(bytes the server's steps needed from the bucket, bytes it fetched,
  bytes its plans hold for steps not made yet), from its metrics."""
  m = top.scrape(f"127.0.0.1:{port}", timeout_s=30)
  total = lambda name: sum(v for (n, _), v in m.items() if n == name)  # noqa: E731
  return (total("elevator_storage_needed_bytes_total"),
          total("elevator_storage_fetched_bytes_total"),
          m.get(("elevator_read_ahead_bytes", ()), 0.0))


def _systems(w: workloads_lib.Workload, workers: int, local: LocalServer, bucket: LocalServer,
             noplan: LocalServer, urls: list[str], env: dict[str, str],
             cache_bytes: int, cache_root: str) -> list[harness.System]:
  base = {"workload": w.name, "global_batch_size": w.global_batch_size}
  service = {**base, "system": "service", "dataset": w.name, "client": _client(w, workers)}
  out = [
      harness.System("local", f"service W={workers}, local files", {
          **service, "target": local.target, "server_pids": [local.proc.pid]}, "service"),
      harness.System("bucket", f"service W={workers}, bucket, reads by plan (default)", {
          **service, "target": bucket.target, "server_pids": [bucket.proc.pid]}, "service"),
      harness.System("bucket_noplan", f"service W={workers}, bucket, --read-ahead-mb 0", {
          **service, "target": noplan.target, "server_pids": [noplan.proc.pid]}, "service"),
  ]
  grain = {**base, "system": "grain", "options": w.options, "threads": GRAIN_THREADS,
           "mp_workers": 0, "files": [], **({"pipeline": "image"} if w.kind == "image" else {})}
  out.append(harness.System("grain_per_record", f"local Grain, per-record reads, "
                            f"{GRAIN_THREADS} threads", {
      **grain, "bucket_source": {"kind": "per_record", "urls": urls, "env": env}}, "grain"))
  out.append(harness.System("grain_shard_cache", f"local Grain, whole shards, cache "
                            f"{CACHE_FRACTION:.0%} of data", {
      **grain, "bucket_source": {"kind": "shard_cache", "urls": urls, "env": env,
                                 "limit_bytes": cache_bytes, "cache_root": cache_root}},
      "grain"))
  return out


def run_workload(root: pathlib.Path, name: str, *, workers: int, repeats: int, seconds: float,
                 warmup_s: float, latency_ms: float = DEFAULT_LATENCY_MS,
                 records: int | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry.
  `global_batch_size`: G instead of the workload's own (0: its own)."""
  w = workloads_lib.at_batch_size(workloads_lib.WORKLOADS[name], global_batch_size)
  n = records or RECORDS[name]
  data = root / "buckets"
  wanted = max(1, -(-n * w.record_bytes // SHARD_BYTES))
  shards = -(-n // -(-n // wanted))  # so that none is empty (write_shards fills in order)
  harness.log(f"[{name}/s3] preparing {n:,} records in {shards} shards in {data / name} ...")
  if len(workloads_lib.shard_files(data, w)) != shards:  # written for another count
    for marker in (data / name).glob(".complete-*"):
      marker.unlink()
  config = workloads_lib.prepare(data, w, n, num_shards=shards)
  files = workloads_lib.shard_files(data, w)
  workloads_lib.warm_page_cache(files)
  servers: list[LocalServer] = []
  with bucket_copy(name, files, latency_ms) as (proxy, urls, env), \
      tempfile.TemporaryDirectory(prefix="elevator-bench-cache-") as cache_root:
    bucket_config = bucket_config_of(config, name)
    num, stored = stored_bytes(urls, env)
    per_record = stored / num
    try:
      local = LocalServer(config, workers=workers)
      servers.append(local)
      ports = {"bucket": free_port(), "bucket_noplan": free_port()}
      bucket = LocalServer(str(bucket_config), workers=workers, env=env,
                           extra_args=["--metrics-port", str(ports["bucket"])])
      servers.append(bucket)
      noplan = LocalServer(str(bucket_config), workers=workers, env=env,
                           extra_args=["--read-ahead-mb", "0",
                                       "--metrics-port", str(ports["bucket_noplan"])])
      servers.append(noplan)
      cache_bytes = int(sum(os.path.getsize(f) for f in files) * CACHE_FRACTION)
      systems = _systems(w, workers, local, bucket, noplan, urls, env, cache_bytes, cache_root)
      pids = [s.proc.pid for s in servers]
      marks: dict[str, int] = {}

      def before() -> None:
        images.wait_idle(pids)
        marks.update(sent=proxy.stats.body_bytes, requests=proxy.stats.ranged_gets,
                     **{k: server_bytes(p) for k, p in ports.items()})

      def derive(s: harness.System, r: dict[str, Any]) -> dict[str, Any]:
        sent = proxy.stats.body_bytes - marks["sent"]
        gets = proxy.stats.ranged_gets - marks["requests"]
        out = {**r, "storage_bytes": sent, "storage_requests": gets, "amplification": None,
               "requests_per_record": None}
        if s.key in ports:  # the server's own counts (its metrics)
          (needed0, fetched0, _), (needed, fetched, _) = (marks[s.key],
                                                          server_bytes(ports[s.key]))
          out["amplification"] = (fetched - fetched0) / max(1.0, needed - needed0)
          out["requests_per_record"] = gets / max(1.0, (needed - needed0) / per_record)
        elif s.key != "local":  # local Grain: the records it pulled
          out["amplification"] = sent / (r["records_total"] * per_record)
          out["requests_per_record"] = gets / r["records_total"]
        return out

      raw = harness.interleaved(f"{name}/s3", systems, repeats, seconds, warmup_s,
                                before=before, derive=derive)
    finally:
      for server in servers:
        server.stop()
  rows = harness.rows(systems, raw, (
      "records_per_s", "gb_per_s", "client_cores", "client_cpu_s_per_gb", "server_cores",
      "amplification", "requests_per_record", "first_batch_s", "resume_first_batch_s"))
  return {"kind": "storage", "latency_ms": latency_ms, "records": n, "shards": shards,
          "shard_bytes": SHARD_BYTES, "record_bytes": round(per_record),
          "global_batch_size": w.global_batch_size, "workers": workers, "systems": rows}


def run(root: pathlib.Path, workload_names: list[str], *, workers: int, repeats: int,
        seconds: float, warmup_s: float, latency_ms: float = DEFAULT_LATENCY_MS,
        records: dict[str, int] | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  import sys  # pylint: disable=g-import-not-at-top
  report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                            "repeats": repeats, "seconds": seconds, "storage": "s3",
                            "workloads": {}}
  began = time.perf_counter()
  for name in workload_names:
    if name not in WORKLOADS:
      raise ValueError(f"--storage s3 runs the workloads {', '.join(WORKLOADS)}, not {name!r}")
    if name == "text":
      from grain_elevator.tools.bench import bucket_text  # pylint: disable=g-import-not-at-top
      report["workloads"][name] = bucket_text.run_workload(
          root, workers=workers, repeats=repeats, seconds=seconds, warmup_s=warmup_s,
          latency_ms=latency_ms, documents=(records or {}).get(name) or None,
          global_batch_size=global_batch_size)
      continue
    report["workloads"][name] = run_workload(
        root, name, workers=workers, repeats=repeats, seconds=seconds, warmup_s=warmup_s,
        latency_ms=latency_ms, records=(records or {}).get(name) or None,
        global_batch_size=global_batch_size)
  report["wall_s"] = time.perf_counter() - began
  return report


def goals(wl: dict[str, Any]) -> list[str]:
  """The issue's three goals, met or by how much not."""
  rows = wl["systems"]
  med = lambda key, fig: (rows[key][fig] or {}).get("median")  # noqa: E731
  out = []
  vs_local = med("bucket", "records_per_s") / med("local", "records_per_s")
  out.append(f"from the bucket {vs_local:.2f}× the same server from local files "
             f"(goal ≥ 0.8: {'met' if vs_local >= 0.8 else 'not met'})")
  vs_grain = med("bucket", "records_per_s") / med("grain_per_record", "records_per_s")
  out.append(f"{vs_grain:.1f}× local Grain's per-record reads from the bucket "
             f"(goal ≥ 5: {'met' if vs_grain >= 5 else 'not met'})")
  amp = med("bucket", "amplification")
  out.append(f"read amplification {amp:.2f}× (goal ≤ 1.5: {'met' if amp <= 1.5 else 'not met'})")
  return out


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  if wl["kind"] == "storage_text":
    from grain_elevator.tools.bench import bucket_text  # pylint: disable=g-import-not-at-top
    return bucket_text.table(name, wl, repeats)
  rows = wl["systems"]
  local = rows["local"]["records_per_s"]["median"]
  lines = [f"### {name} from S3 (moto behind the proxy, {wl['latency_ms']:g} ms a request): "
           f"{wl['records']:,} records of {wl['record_bytes']:,} B stored, {wl['shards']} "
           f"shards, G={wl['global_batch_size']}; median (min–max) of {repeats} runs", "",
           "| system | records/s | × local files | trainer cores | server cores | "
           "read amplification | requests/record | first batch ms | resume ms |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows.values():
    f = lambda key, scale=1.0, digits=0: harness.fmt(r.get(key), scale, digits)  # noqa: E731
    lines.append(
        f"| {r['label']} | {f('records_per_s')} | {r['records_per_s']['median'] / local:.2f} | "
        f"{f('client_cores', digits=2)} | {f('server_cores', digits=2)} | "
        f"{f('amplification', digits=2)} | {f('requests_per_record', digits=3)} | "
        f"{f('first_batch_s', 1e3)} | {f('resume_first_batch_s', 1e3)} |")
  return lines + [""] + [f"- {g}" for g in goals(wl)] + [""]
