"""Orchestrates `elevator bench`: data, servers, interleaved repeats, report."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server.process.supervisor import WORKER_ENV
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import portfile
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

TCP = [sys.executable, "-m", "grain_elevator.tools.bench.tcp"]
FLOOR = [sys.executable, "-m", "grain_elevator.tools.bench.floor"]


def client_settings(w: workloads_lib.Workload, workers: int, **transport: Any
                     ) -> dict[str, Any]:
  """RemoteDataset's arguments (consume.py builds its TransportOptions).

  About two requests in flight per server worker (one reading while the
  other sends), never fewer than 4 connections: 4 beat 2 by 11-17% on large
  records in interleaved A/B runs on 2 cores. Several steps per request
  amortise its overhead; prefetch keeps every connection busy."""
  connections = max(4, 2 * workers)
  steps = 4 if w.name == "small" else 3
  return {"prefetch": connections * steps,
          "transport": {"steps_per_request": steps, "connections_per_target": connections,
                        **transport}}


def _systems(w: workloads_lib.Workload, files: list[str], config: str,
             servers: dict[int, LocalServer], ar_server: LocalServer | None,
             tcp_port: int | None, floor_ports: list[int], tf_services: dict[int, Any],
             tf_files: list[str]) -> list[harness.System]:
  base = {"workload": w.name, "global_batch_size": w.global_batch_size}
  out = []
  for threads in (0, 16):
    for mp in (0, 2):
      label = f"(a) local Grain, threads={threads or 0}, mp_prefetch={mp}"
      out.append(harness.System(f"grain_t{threads}_mp{mp}", label, {
          **base, "system": "grain", "files": files, "options": w.options,
          "threads": threads, "mp_workers": mp}, "grain"))
  out.append(harness.System("embedded", "(b) grain-elevator embedded", {
      **base, "system": "embedded", "target": f"local:{config}", "dataset": w.name,
      "client": {"prefetch": 2}}, "embedded"))
  for workers, server in servers.items():
    out.append(harness.System(f"service_w{workers}", f"(c) grain-elevator service, W={workers}", {
        **base, "system": "service", "target": server.target, "dataset": w.name,
        "client": client_settings(w, workers)}, "service"))
  top = max(servers)
  service = {**base, "system": "service", "target": servers[top].target, "dataset": w.name}
  out.append(harness.System(f"service_w{top}_default", f"(c) service, W={top}, default RemoteDataset",
                    {**service, "client": {}}, "service"))
  if _has_torch():
    out.append(harness.System(f"service_w{top}_torch",
                              f"(c) service, W={top}, default RemoteDataset, torch tensors", {
        **service, "client": {}, "torch": True}, "service"))
  out.append(harness.System(f"service_w{top}_grpc", f"(c) service, W={top}, gRPC transport", {
      **service, "client": client_settings(w, top, kind="grpc")}, "service"))
  out.append(harness.System(f"service_w{top}_zstd", f"(c) service, W={top}, zstd compression", {
      **service, "client": client_settings(w, top, compression="zstd")}, "service"))
  out.append(harness.System(f"service_w{top}_per_record",
                    f"(c) service, W={top}, per-record pipeline (no batch_transform)", {
      **service, "dataset": f"{w.name}_per_record", "client": client_settings(w, top)}, "service"))
  if ar_server is not None:
    out.append(harness.System(f"service_w{top}_arrayrecord",
                      f"(c) service, W={top}, shards read through ArrayRecord", {
        **service, "target": ar_server.target, "client": client_settings(w, top)}, "service"))
  if tcp_port is not None:
    out.append(harness.System("tcp", "(d) plain TCP socket, same bytes", {
        **base, "system": "tcp", "tcp_port": tcp_port,
        "batch_bytes": w.global_batch_size * w.delivered_bytes_per_record}, "tcp"))
  if floor_ports:
    out.append(harness.System("floor", f"(f) floor: shard reads + TCP, W={len(floor_ports)}, "
                      "raw records", {
        **base, "system": "floor", "ports": floor_ports,
        "batch_bytes": w.global_batch_size * w.record_bytes}, "floor"))
  from grain_elevator.tools.bench import tfdata  # pylint: disable=g-import-not-at-top
  for workers, svc in tf_services.items():
    out.append(harness.System(f"tfdata_w{workers}", f"(e) tf.data service, W={workers}", {
        **base, **tfdata.consume_spec(w, svc.target, tf_files)}, "tfdata"))
  return out


def _has_torch() -> bool:
  """Whether the torch row can run (the `torch` extra)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("torch") is not None


def _has_tensorflow() -> bool:
  from grain_elevator.tools.bench import tfdata  # pylint: disable=g-import-not-at-top
  return tfdata.available()


_FLOOR_NOTE = ("(f) floor: W processes that only read random records with the server's "
               "shard reader and send their raw bytes (no Grain, decode, framing or gRPC), "
               "received into fresh buffers: the most a server reading these shards this way "
               "gets from these cores. It moves raw records, so on small compare records/s, "
               "not GB/s.")
_READER_NOTE = ("'shards read through ArrayRecord': the same server with "
                f"{shard_reader.READER_ENV}=arrayrecord, i.e. ArrayRecord's own reader instead "
                "of server/data/shards/reader.py: what the shard reader is worth, in the same run.")


def _tfdata_note(ran: bool) -> str:
  if not ran:
    return ("(e) tf.data service: skipped, TensorFlow is not installed "
            "(pip install 'grain-elevator[tfdata]'). Figures measured on this machine "
            "are in BENCHMARKS.md.")
  return ("(e) tf.data service: one dispatcher and W worker processes on the same records "
          "as TFRecord; file shuffle + a record shuffle buffer (it has no global shuffle); "
          "compression off (its fastest here); its iterators cannot resume, so n/a.")


def run(*, data_dir: str | None, workload_names: list[str], workers: list[int],
        repeats: int, seconds: float, warmup_s: float,
        records: dict[str, int], tfdata: bool = True, global_batch_size: int = 0
        ) -> dict[str, Any]:
  """Runs every system of every workload `repeats` times, interleaved; at
  `global_batch_size` instead of each workload's own G where it is not 0."""
  root = pathlib.Path(data_dir or os.path.join(tempfile.gettempdir(), "grain-elevator-bench"))
  report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                            "repeats": repeats, "seconds": seconds, "workloads": {}}
  for name in workload_names:
    if name == "text":  # its own systems and figures: bench/text.py
      from grain_elevator.tools.bench import text  # pylint: disable=g-import-not-at-top
      report["workloads"][name] = text.run_workload(
          root, records.get(name) or text.WORKLOAD.default_records, workers=workers,
          repeats=repeats, seconds=seconds, warmup_s=warmup_s,
          global_batch_size=global_batch_size)
      continue
    w = workloads_lib.at_batch_size(workloads_lib.WORKLOADS[name], global_batch_size)
    n = records.get(name) or w.default_records
    if w.kind == "image":  # its own systems and figures: bench/images.py
      from grain_elevator.tools.bench import images  # pylint: disable=g-import-not-at-top
      report["workloads"][name] = images.run_workload(
          root, w, n, workers=workers, repeats=repeats, seconds=seconds,
          warmup_s=warmup_s, tfdata=tfdata)
      continue
    harness.log(f"[{name}] preparing {n:,} records of {w.record_bytes:,} B in {root / name} ...")
    config = workloads_lib.prepare(
        root, w, n, progress=lambda i, k: harness.log(f"[{name}]   shard {i}/{k} written"))
    files = workloads_lib.shard_files(root, w)
    workloads_lib.warm_page_cache(files)
    servers: dict[int, LocalServer] = {}
    ar_server: LocalServer | None = None
    tf_services: dict[int, Any] = {}
    tf_files: list[str] = []
    run_tf = tfdata and _has_tensorflow()
    tcp_proc, tcp_port = None, None
    floor_procs: list[subprocess.Popen] = []
    try:
      for wk in workers:
        servers[wk] = LocalServer(config, workers=wk)
        harness.log(f"[{name}] server W={wk} on {servers[wk].target}")
      if shard_reader.available():
        ar_server = LocalServer(config, workers=max(workers),
                                env={shard_reader.READER_ENV: "arrayrecord"})
        harness.log(f"[{name}] server W={max(workers)}, ArrayRecord's reader, on {ar_server.target}")
      if run_tf:
        from grain_elevator.tools.bench import tfdata as tfdata_lib  # pylint: disable=g-import-not-at-top
        harness.log(f"[{name}] writing the records as TFRecord for tf.data ...")
        tf_files = tfdata_lib.prepare_tfrecords(root, w)
        workloads_lib.warm_page_cache(tf_files)
        for wk in workers:
          tf_services[wk] = tfdata_lib.TfDataService(wk)
          harness.log(f"[{name}] tf.data service W={wk} on {tf_services[wk].target}")
      port_file = root / f"tcp-port-{os.getpid()}"
      batch_bytes = w.global_batch_size * w.delivered_bytes_per_record
      tcp_proc = subprocess.Popen([*TCP, str(port_file), str(batch_bytes)])
      tcp_port = portfile.wait(port_file, tcp_proc, time.monotonic() + 30)
      if tcp_port is None:
        raise RuntimeError(f"the TCP sender ({' '.join(TCP)}) did not start within 30 s")
      port_file.unlink()
      floor_ports = _start_floor(root, w, files, max(workers), floor_procs)
      systems = _systems(w, files, config, servers, ar_server, tcp_port, floor_ports,
                         tf_services, tf_files)
      raw = harness.interleaved(name, systems, repeats, seconds, warmup_s)
    finally:
      for server in [*servers.values(), ar_server]:
        if server:
          server.stop()
      for svc in tf_services.values():
        svc.stop()
      for proc in [tcp_proc, *floor_procs]:
        if proc:
          proc.kill()
          proc.wait()
    rows = harness.rows(systems, raw, ("records_per_s", "gb_per_s", "client_cpu_s_per_gb",
                                       "client_cores", "first_batch_s", "resume_first_batch_s"))
    report["workloads"][name] = {
        "record_bytes": w.record_bytes, "delivered_bytes_per_record": w.delivered_bytes_per_record,
        "global_batch_size": w.global_batch_size, "records": n, "systems": rows,
        "notes": [_FLOOR_NOTE, _READER_NOTE, _tfdata_note(run_tf), *_torch_note(rows)]}
  return report


def _torch_note(rows: dict[str, Any]) -> list[str]:
  """The torch row's trainer CPU per GB against numpy's, same client, same run."""
  tensors = next((r for k, r in rows.items() if k.endswith("_torch")), None)
  arrays = next((r for k, r in rows.items() if k.endswith("_default")), None)
  if tensors is None or arrays is None:
    return []
  ratio = (tensors["client_cpu_s_per_gb"]["median"]
           / arrays["client_cpu_s_per_gb"]["median"])
  return [f"torch tensors (TorchLoader over the default RemoteDataset) cost the trainer "
          f"{ratio:.2f}x the CPU per GB of its numpy batches: torch.from_numpy over the "
          "received bytes, no copy"]


def _start_floor(root: pathlib.Path, w: workloads_lib.Workload, files: list[str],
                 senders: int, procs: list[subprocess.Popen]) -> list[int]:
  """Starts the floor's sender processes (bench/floor.py); their ports."""
  ports = []
  for i in range(senders):
    port_file = root / f"floor-port-{os.getpid()}-{i}"
    procs.append(subprocess.Popen([*FLOOR, str(port_file), str(w.global_batch_size), *files],
                                  env={**WORKER_ENV, **os.environ}))  # as `elevator serve` does
    port = portfile.wait(port_file, procs[-1], time.monotonic() + 30)
    if port is None:
      raise RuntimeError(f"the floor sender ({' '.join(FLOOR)}) did not start within 30 s")
    port_file.unlink()
    ports.append(port)
  return ports


def table(report: dict[str, Any]) -> str:
  """Markdown tables, one per workload, with ratios to the peers."""
  lines = []
  for name, wl in report["workloads"].items():
    if wl.get("kind") == "image":
      from grain_elevator.tools.bench import images  # pylint: disable=g-import-not-at-top
      lines += images.table(name, wl, report["repeats"])
      continue
    if wl.get("kind") == "text":
      from grain_elevator.tools.bench import text  # pylint: disable=g-import-not-at-top
      lines += text.table(name, wl, report["repeats"])
      continue
    rows = wl["systems"]
    grain_best = max((r for r in rows.values() if r["kind"] == "grain"),
                     key=lambda r: r["records_per_s"]["median"])
    tcp = rows.get("tcp")
    lines += [f"### {name}: {wl['record_bytes']:,} B records, G={wl['global_batch_size']}, "
              f"{wl['records']:,} records; median (min–max) of {report['repeats']} runs", "",
              "| system | records/s | GB/s | × best local Grain | × TCP GB/s | "
              "client CPU s/GB | first batch ms | resume @10⁶ ms |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
      ratio = r["records_per_s"]["median"] / grain_best["records_per_s"]["median"]
      tcp_ratio = (f"{r['gb_per_s']['median'] / tcp['gb_per_s']['median']:.2f}"
                   if tcp else "n/a")
      lines.append(
          f"| {r['label']} | {harness.fmt(r['records_per_s'])} | {harness.fmt(r['gb_per_s'], digits=3)} | "
          f"{ratio:.2f} | {tcp_ratio} | {harness.fmt(r['client_cpu_s_per_gb'], digits=2)} | "
          f"{harness.fmt(r['first_batch_s'], 1e3)} | {harness.fmt(r['resume_first_batch_s'], 1e3)} |")
    lines += [""] + [f"- {n}" for n in wl["notes"]] + [""]
  return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [n for n, wl in report["workloads"].items() if wl.get("kind") != "text"]
  fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5), squeeze=False)
  for ax, name in zip(axes[0], names):
    rows = list(report["workloads"][name]["systems"].values())
    labels = [r["label"].replace("grain-elevator ", "") for r in rows]
    med = [r["gb_per_s"]["median"] for r in rows]
    err = [[m - r["gb_per_s"]["min"] for m, r in zip(med, rows)],
           [r["gb_per_s"]["max"] - m for m, r in zip(med, rows)]]
    colors = {"grain": "#999999", "embedded": "#6baed6", "service": "#2171b5",
              "tcp": "#fd8d3c", "floor": "#fdd0a2", "tfdata": "#74c476"}
    ax.barh(range(len(rows)), med, xerr=err, color=[colors[r["kind"]] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s delivered to the trainer process (median, min–max)")
    wl = report["workloads"][name]
    ax.set_title(f"{name}: {wl['record_bytes']:,} B records, G={wl['global_batch_size']}"
                 + (" (JPEG, decoded and cropped)" if wl.get("kind") == "image" else ""))
  fig.suptitle(f"elevator bench, {report['machine']['cpus']} cores")
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
