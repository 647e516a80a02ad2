"""`elevator bench`'s image workload: decode JPEG, random resized crop, flip.

The work an ImageNet trainer's input pipeline does, done three ways on the
same records (pipelines/images.py's format, written by `workloads.prepare`):

(a) local Grain on the trainer's own CPUs (`images.train_pipeline`), at four
    settings of read threads and `mp_prefetch` processes;
(c) the service running the same pipeline: `elevator serve` with its
    defaults and a default `RemoteDataset`, then each W with the client
    settings the bench uses;
(e) tf.data service with TensorFlow's own ops (`tfdata.image_dataset`) over
    the same records as TFRecord.

Besides images/s, what each image costs: CPU seconds of the trainer
process (and its mp_prefetch children) per 1,000 images, and images/s per
core of the processes doing the work (the server's processes; for local
Grain, the trainer's).
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import psutil

from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import tfdata as tfdata_lib
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

GRAIN_SETTINGS = ((0, 0), (0, 2), (16, 0), (16, 2))  # (read threads, mp_prefetch workers)
IDLE_CORES = 0.05  # the servers are "idle" below this many busy cores
IDLE_TIMEOUT_S = 20.0


def client_settings(workers: int) -> dict[str, Any]:
  """The bench's client settings for 9.6 MB steps: one step a request (a
  step is ~0.1 core-second of work: nothing to amortise), two connections per
  server worker and never fewer than 4, one step in flight on each."""
  connections = max(4, 2 * workers)
  return {"prefetch": connections,
          "transport": {"steps_per_request": 1, "connections_per_target": connections}}


def _server_pids(server: LocalServer) -> list[int]:
  return [server.proc.pid]  # its workers are its children: consume.py counts them


def _busy_cores(pids: list[int], window_s: float = 0.5) -> float:
  def cpu() -> float:
    total = 0.0
    for pid in pids:
      try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
          total += sum(p.cpu_times()[:2])
      except psutil.Error:
        pass
    return total
  c0 = cpu()
  time.sleep(window_s)
  return (cpu() - c0) / window_s


def wait_idle(pids: list[int]) -> None:
  """Waits (at most IDLE_TIMEOUT_S) until the servers have stopped working
  for the last system: a tf.data worker keeps filling its buffers for a few
  seconds after its trainer left, which would be charged to the next system."""
  deadline = time.monotonic() + IDLE_TIMEOUT_S
  while time.monotonic() < deadline and _busy_cores(pids) > IDLE_CORES:
    pass


def _systems(w: workloads_lib.Workload, files: list[str], default: LocalServer,
             servers: dict[int, LocalServer], tf_services: dict[int, Any],
             tf_files: list[str]) -> list[harness.System]:
  base = {"workload": w.name, "global_batch_size": w.global_batch_size}
  out = []
  for threads, mp in GRAIN_SETTINGS:
    out.append(harness.System(
        f"grain_t{threads}_mp{mp}", f"(a) local Grain, threads={threads}, mp_prefetch={mp}", {
            **base, "system": "grain", "pipeline": "image", "files": files,
            "options": w.options, "threads": threads, "mp_workers": mp}, "grain"))
  service = {**base, "system": "service", "dataset": w.name}
  workers = os.cpu_count() or 1
  out.append(harness.System(
      "service_default", f"(c) service, `elevator serve` defaults (W={workers}), "
      "default RemoteDataset", {**service, "target": default.target, "client": {},
                                "server_pids": _server_pids(default)}, "service"))
  for wk, server in servers.items():
    out.append(harness.System(
        f"service_w{wk}", f"(c) service, W={wk}, bench client settings", {
            **service, "target": server.target, "client": client_settings(wk),
            "server_pids": _server_pids(server)}, "service"))
  for wk, svc in tf_services.items():
    out.append(harness.System(f"tfdata_w{wk}", f"(e) tf.data service, W={wk}, TF ops", {
        **base, **tfdata_lib.consume_spec(w, svc.target, tf_files),
        "server_pids": svc.pids()}, "tfdata"))
  return out


def run_workload(root: pathlib.Path, w: workloads_lib.Workload, num_records: int, *,
                 workers: list[int], repeats: int, seconds: float, warmup_s: float,
                 tfdata: bool = True) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry."""
  log = harness.log
  log(f"[{w.name}] preparing {num_records:,} JPEG records in {root / w.name} ...")
  config = workloads_lib.prepare(
      root, w, num_records, progress=lambda i, k: log(f"[{w.name}]   shard {i}/{k} written"))
  files = workloads_lib.shard_files(root, w)
  workloads_lib.warm_page_cache(files)
  run_tf = tfdata and tfdata_lib.available()
  servers: dict[int, LocalServer] = {}
  default: LocalServer | None = None
  tf_services: dict[int, Any] = {}
  tf_files: list[str] = []
  try:
    for wk in workers:
      servers[wk] = LocalServer(config, workers=wk)
      log(f"[{w.name}] server W={wk} on {servers[wk].target}")
    # `elevator serve`'s default is one worker per core: the same server, if started.
    default = servers.get(os.cpu_count() or 1) or LocalServer(config, workers=os.cpu_count() or 1)
    if run_tf:
      log(f"[{w.name}] writing the records as TFRecord for tf.data ...")
      tf_files = tfdata_lib.prepare_tfrecords(root, w)
      workloads_lib.warm_page_cache(tf_files)
      for wk in workers:
        tf_services[wk] = tfdata_lib.TfDataService(wk)
        log(f"[{w.name}] tf.data service W={wk} on {tf_services[wk].target}")
    systems = _systems(w, files, default, servers, tf_services, tf_files)
    all_pids = [pid for s in systems for pid in s.spec.get("server_pids", [])]
    raw = harness.interleaved(w.name, systems, repeats, seconds, warmup_s,
                              before=lambda: wait_idle(all_pids), derive=_derived,
                              unit="img/s")
  finally:
    for server in {id(s): s for s in [*servers.values(), default] if s}.values():
      server.stop()
    for svc in tf_services.values():
      svc.stop()
  rows = harness.rows(systems, raw, (
      "records_per_s", "gb_per_s", "client_cpu_s_per_gb", "client_cores", "server_cores",
      "client_cpu_s_per_1k", "server_cpu_s_per_1k", "images_per_core_s", "first_batch_s",
      "resume_first_batch_s"))
  return {"kind": "image", "record_bytes": w.record_bytes,
          "delivered_bytes_per_record": w.delivered_bytes_per_record,
          "global_batch_size": w.global_batch_size, "records": num_records,
          "image_size": w.height, "systems": rows, "notes": _notes(run_tf)}


def _derived(s: harness.System, r: dict[str, Any]) -> dict[str, Any]:
  """Per-image costs of one run. Images/s per core: of the server's
  processes where there is a server, else of the trainer's (local Grain)."""
  rate = r["records_per_s"]
  out = {**r, "client_cpu_s_per_1k": r["client_cores"] / rate * 1000}
  if "server_cores" in r:
    out["server_cpu_s_per_1k"] = r["server_cores"] / rate * 1000
    out["images_per_core_s"] = rate / r["server_cores"] if r["server_cores"] else None
  else:
    out["images_per_core_s"] = rate / r["client_cores"] if r["client_cores"] else None
  return out


def _notes(ran_tf: bool) -> list[str]:
  tf = ("(e) tf.data service: one dispatcher and W workers running TensorFlow's "
        "decode_jpeg, sample_distorted_bounding_box (area 0.08-1, aspect 3/4-4/3, 10 "
        "attempts), bilinear resize and random flip on the same records as TFRecord; "
        "file shuffle + a 2,354-record buffer; compression off."
        if ran_tf else
        "(e) tf.data service: skipped, TensorFlow is not installed (pip install "
        f"'grain-elevator[tfdata]', or name an interpreter that has it in "
        f"{tfdata_lib.TF_PYTHON_ENV}).")
  return [
      "images/s per core: images/s over the cores busy doing the work in the counted "
      "window: the server's processes (supervisor and workers; tf.data: dispatcher and "
      "workers) where there is a server, the trainer's process and its mp_prefetch "
      "children for local Grain.",
      "trainer CPU s / 1,000 images: CPU seconds of the trainer process (and its "
      "mp_prefetch children) per 1,000 images delivered.",
      "Every system shares the machine's cores with the others' idle processes; before "
      "each measurement the bench waits until every server is idle.",
      tf]


def _fmt(s: dict[str, float] | None, digits: int = 0) -> str:
  return harness.fmt(s, digits=digits)


def goals(wl: dict[str, Any]) -> list[str]:
  """The two goals of issue #18 against the best local Grain, in words."""
  rows = wl["systems"]
  grain = [r for r in rows.values() if r["kind"] == "grain"]
  services = {k: r for k, r in rows.items() if r["kind"] == "service"}
  if not grain or not services:
    return []
  best = max(grain, key=lambda r: r["records_per_s"]["median"])
  cpu, per_core = best["client_cpu_s_per_1k"]["median"], best["images_per_core_s"]["median"]
  out = [f"Best local Grain: {best['label'][4:]} — {best['records_per_s']['median']:,.0f} "
         f"images/s, {per_core:,.0f} images/s per trainer core, {cpu:.3f} trainer CPU s "
         "per 1,000 images."]
  for r in services.values():
    c = r["client_cpu_s_per_1k"]["median"]
    p = (r["images_per_core_s"] or {}).get("median") or 0.0
    out.append(f"{r['label'][4:]}: {harness.against_local('image', c, cpu, p, per_core)}.")
  return out


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  rows = wl["systems"]
  best = max((r for r in rows.values() if r["kind"] == "grain"),
             key=lambda r: r["records_per_s"]["median"])
  lines = [f"### {name}: JPEG records (~{wl['record_bytes'] // 1000} KB, ~500x375) → "
           f"uint8 {wl['image_size']}x{wl['image_size']}x3, G={wl['global_batch_size']}, "
           f"{wl['records']:,} records; median (min–max) of {repeats} runs", "",
           "| system | images/s | × best local Grain | images/s per core (server's; "
           "local: trainer's) | trainer CPU s / 1,000 images | server CPU s / 1,000 images "
           "| trainer cores | first batch ms |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows.values():
    ratio = r["records_per_s"]["median"] / best["records_per_s"]["median"]
    lines.append(
        f"| {r['label']} | {_fmt(r['records_per_s'])} | {ratio:.2f} | "
        f"{_fmt(r['images_per_core_s'])} | {_fmt(r['client_cpu_s_per_1k'], 3)} | "
        f"{_fmt(r['server_cpu_s_per_1k'], 2)} | {_fmt(r['client_cores'], 2)} | "
        f"{harness.fmt(r['first_batch_s'], 1e3)} |")
  return lines + [""] + [f"- {g}" for g in goals(wl)] + [f"- {n}" for n in wl["notes"]] + [""]
