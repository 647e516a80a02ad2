"""Client settings side by side: a default `RemoteDataset` against the best
of a sweep of tuned ones, at several server sizes.

Users run defaults, so the default must be near the best hand-tuned setting
whatever the server's worker count W: the goal is a default at GOAL of the
best tuned setting or more at every W. For each workload (small, large,
image, text, costly) and each W: one server (`elevator serve`'s defaults but
W, and no batch cache, which would serve a setting the steps an earlier one
made), then each client setting measured in a fresh process for `--seconds`,
interleaved over `--rounds`, next to a plain TCP socket moving the same
bytes. "× best tuned" divides by the fastest tuned row of the same W.

The sweep (`sweep`), kept to 9 settings a block so that a full run (5
workloads, W = 2, 8, 16, 2 rounds) takes about 40 minutes on 2 cores
(costly and small alone took 17.5):
  * connections per target: 1, 2 and 4 per server worker (at most
    MAX_SWEEP_CONNECTIONS): one request per worker; two, which hide a
    batch's send behind the next request's production (what a default
    client opens); four, to show whether still more in flight helps;
  * steps per request: 1 (no batching: what costly records want), the step
    count of SWEEP_REQUEST_BYTES (what the bytes-sized requests measured
    best on the small and large workloads; at most SWEEP_MAX_STEPS, what a
    default client asks at most), and their geometric middle;
  * prefetch: AHEAD_REQUESTS requests per connection (a connection has one
    in flight and the next queued; one replica here), within
    SWEEP_WINDOW_BYTES of steps but never less than a request per
    connection; a point (past one step a request) whose requests alone
    exceed that bound is left out.
`--sweep-connections` and `--sweep-steps` narrow it. `elevator bench`'s own
setting (run.py, images.py) is one more row where it is not on the grid
(it keeps one request per connection). The text workload is a stream, one
request at a time: its sweep is TEXT_STEPS steps a request times
TEXT_AHEAD_REQUESTS requests ahead, with no connections.

At `--workers` the server runs the workload's real pipeline. At
`--sleeping-workers` its pipeline waits `--sleep-us-per-record` per record
instead of computing (tools/bench/sleeping.py): W busy workers, as W real
cores would give, on a machine with fewer, so that how many requests a
client keeps in flight decides the rate:

    python -m grain_elevator.tools.bench.clients [--workloads small,large,image,text,costly] \\
        [--workers 2] [--sleeping-workers 8,16] [--rounds 3] \\
        [--sweep-connections 1,2,4] [--sweep-steps 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from grain_elevator.proto.limits import LONG_STREAM_STEPS
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images as images_bench
from grain_elevator.tools.bench import portfile
from grain_elevator.tools.bench import run as run_lib
from grain_elevator.tools.bench import sleeping
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

EXPLORE: dict[str, dict[str, Any]] = {}  # more label -> client settings (--explore)
TCP_BUFFERS = 0  # > 1: a plain TCP row receiving into that many buffers in turn (--tcp-buffers)
WORKLOADS = ("small", "large", "image", "text", "costly")
TUNED = "tuned"  # the rows "× best tuned" divides by: their labels start so
GOAL = 0.85  # the default's least "× best tuned" at any W
SWEEP_CONNECTIONS_PER_WORKER = (1, 2, 4)
MAX_SWEEP_CONNECTIONS = 64  # a trainer's sockets and threads, on 2 cores
SWEEP_REQUEST_BYTES = 12 << 20
SWEEP_MAX_STEPS = LONG_STREAM_STEPS // 2
AHEAD_REQUESTS = 2
SWEEP_WINDOW_BYTES = 1 << 30  # steps a tuned client holds ahead: more than a default may
TEXT_STEPS = (8, 64)
TEXT_AHEAD_REQUESTS = (4, 8)


def sweep_steps(step_bytes: int) -> tuple[int, ...]:
  """Steps per request swept for steps of `step_bytes`: 1, about
  SWEEP_REQUEST_BYTES of them (at most SWEEP_MAX_STEPS), and between."""
  top = max(1, min(SWEEP_MAX_STEPS, -(-SWEEP_REQUEST_BYTES // max(1, step_bytes))))
  return tuple(sorted({1, round(math.sqrt(top)), top}))


def describe(client: dict[str, Any]) -> str:
  """A setting in words: "16 conns, 2 steps/request, 64 ahead"."""
  transport = client.get("transport", {})
  parts = []
  if "connections_per_target" in transport:
    parts.append(f"{transport['connections_per_target']} conns")
  if "steps_per_request" in transport:
    parts.append(f"{transport['steps_per_request']} steps/request")
  if "prefetch" in client:
    parts.append(f"{client['prefetch']} ahead")
  return ", ".join(parts) or "defaults"


def _bench_setting(name: str, workers: int) -> dict[str, Any] | None:
  """`elevator bench`'s own client setting for workload `name` (run.py,
  images.py); None for a workload it does not run."""
  if name == "image":
    return images_bench.client_settings(workers)
  if name in ("small", "large"):
    return run_lib.client_settings(workloads_lib.WORKLOADS[name], workers)
  return None


def sweep(name: str, workers: int, step_bytes: int,
          connections_per_worker: tuple[int, ...] = SWEEP_CONNECTIONS_PER_WORKER,
          steps: tuple[int, ...] = ()) -> dict[str, dict[str, Any]]:
  """label -> the tuned RemoteDataset arguments swept for workload `name`
  on W workers (module docstring), `steps` replacing the derived steps per
  request where given."""
  if name == "text":
    grid = [{"prefetch": ahead * s, "transport": {"steps_per_request": s}}
            for s in steps or TEXT_STEPS for ahead in TEXT_AHEAD_REQUESTS]
  else:
    conns = sorted({min(MAX_SWEEP_CONNECTIONS, m * workers) for m in connections_per_worker})
    held = max(1, SWEEP_WINDOW_BYTES // max(1, step_bytes))  # steps the bound holds
    grid = [{"prefetch": min(AHEAD_REQUESTS * c * s, max(c * s, held)),
             "transport": {"connections_per_target": c, "steps_per_request": s}}
            for c in conns for s in steps or sweep_steps(step_bytes)
            if s == 1 or c * s <= held]
  out = {f"{TUNED}: {describe(c)}": c for c in grid}
  bench = _bench_setting(name, workers)
  if bench is not None:
    label = next((k for k, c in out.items() if c == bench), None)
    if label is not None:
      del out[label]
    out[f"{TUNED} (elevator bench's): {describe(bench)}"] = bench
  return out


def settings(name: str, workers: int, step_bytes: int, glibc: bool = False,
             connections_per_worker: tuple[int, ...] = SWEEP_CONNECTIONS_PER_WORKER,
             steps: tuple[int, ...] = ()) -> dict[str, dict[str, Any]]:
  """label -> RemoteDataset arguments (plus "tune_malloc")."""
  out: dict[str, dict[str, Any]] = {"default": {"client": {}}}
  if glibc:
    out["default + glibc tunables"] = {"client": {}, "tune_malloc": True}
  for label, client in EXPLORE.items():
    client = dict(client)
    out[label] = {"client": client, "tune_malloc": client.pop("tune_malloc", False)}
  for label, client in sweep(name, workers, step_bytes, connections_per_worker,
                             steps).items():
    out[label] = {"client": client}
    if glibc:
      out[f"{label} + glibc tunables"] = {"client": client, "tune_malloc": True}
  return out


def _prepare(data: pathlib.Path, name: str, records: int | None
             ) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
  """Writes the workload's records (unless present): (its config, a step's
  bytes, its pipeline's options, what the consume spec adds)."""
  if name == "text":
    from grain_elevator.tools.bench import text  # pylint: disable=g-import-not-at-top
    w = text.WORKLOAD
    config, tokenizer = text.prepare(data, w, records or w.default_records)
    workloads_lib.warm_page_cache(sorted(str(p) for p in (data / w.name).glob("*.array_record")))
    options = {"options": {"tokenizer": pathlib.Path(tokenizer).name, "field": "text"},
               "iter_options": {"length": w.length, "num_packing_bins": w.num_packing_bins}}
    step_bytes = w.global_batch_size * w.length * 3 * 4  # tokens, segment ids, positions
    return config, step_bytes, options, {"global_batch_size": w.global_batch_size,
                                         "pipeline": "text"}
  w = workloads_lib.WORKLOADS[name]
  config = workloads_lib.prepare(data, w, records or w.default_records)
  workloads_lib.warm_page_cache(workloads_lib.shard_files(data, w))
  return (config, w.global_batch_size * w.delivered_bytes_per_record, {"options": w.options},
          {"global_batch_size": w.global_batch_size})


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
  gb = [r["gb_per_s"] for r in runs]
  return {"median": statistics.median(gb), "runs": gb,
          "records_per_s": statistics.median(r["records_per_s"] for r in runs),
          "client_cpu_s_per_gb": statistics.median(r["client_cpu_s_per_gb"] for r in runs),
          "client_cpu_runs": [r["client_cpu_s_per_gb"] for r in runs],
          "window": [r.get("window") for r in runs]}


def run(data: pathlib.Path, names: list[str], workers: list[int], sleeping_workers: list[int],
        rounds: int, seconds: float, warmup_s: float, records: int | None = None,
        sleep_us: float | None = None, glibc: bool = False,
        save: Callable[[dict[str, Any]], None] = lambda report: None,
        connections_per_worker: tuple[int, ...] = SWEEP_CONNECTIONS_PER_WORKER,
        steps: tuple[int, ...] = ()) -> dict[str, Any]:
  """report[workload]["W=n"]: the server's pipeline, each setting's runs and
  the best tuned one; `save(report)` after each block, so a run cut short
  keeps what it measured."""
  report: dict[str, Any] = {}
  for name in names:
    config, step_bytes, options, base_spec = _prepare(data, name, records)
    us = sleeping.DEFAULT_SLEEP_US[name] if sleep_us is None else sleep_us
    slow_config = sleeping.config(data, name, us, **options) if sleeping_workers else None
    port_file = data / f"clients-tcp-port-{name}"
    port_file.unlink(missing_ok=True)
    sender = subprocess.Popen([*run_lib.TCP, str(port_file), str(step_bytes)])
    report[name] = {}
    try:
      tcp_port = portfile.wait(port_file, sender, time.monotonic() + 30)
      if tcp_port is None:
        raise RuntimeError(f"the TCP sender ({' '.join(run_lib.TCP)}) did not start within 30 s")
      # Every setting reads the stream from step 0: the batch cache would serve
      # a later one the steps an earlier one had made. A stream's sessions
      # share the budget and are needed (each request would replay), and
      # hold nothing a reader starting over could use.
      extra = [] if name == "text" else ["--batch-cache-mb", "0"]
      blocks = [(w, False) for w in workers] + [(w, True) for w in sleeping_workers]
      for wk, slow in blocks:
        key = f"W={wk}" + (" sleeping" if slow else "")
        report[name][key] = _block(name, key, LocalServer(slow_config if slow else config,
                                                          workers=wk, extra_args=extra),
                                   settings(name, wk, step_bytes, glibc, connections_per_worker,
                                            steps),
                                   base_spec, tcp_port, step_bytes, rounds, seconds, warmup_s)
        report[name][key].update(workers=wk, pipeline=f"sleeping {us:g} µs/record" if slow
                                 else "real", global_batch_size=base_spec["global_batch_size"],
                                 best=best(report[name][key]["rows"]))
        save(report)
    finally:
      sender.kill()
      sender.wait()
  return report


def _block(name: str, key: str, server: LocalServer, systems: dict[str, dict[str, Any]],
           base_spec: dict[str, Any], tcp_port: int, step_bytes: int, rounds: int,
           seconds: float, warmup_s: float) -> dict[str, Any]:
  """Every setting against one server, and plain TCP, `rounds` times interleaved."""
  rotating = f"plain TCP, {TCP_BUFFERS} buffers in turn"
  sockets = ["plain TCP"] + ([rotating] if TCP_BUFFERS > 1 else [])
  runs: dict[str, list[dict[str, Any]]] = {k: [] for k in [*systems, *sockets]}
  base = {"workload": name, **base_spec, "seconds": seconds, "warmup_s": warmup_s}
  with server:
    for rnd in range(rounds):
      for label, s in systems.items():
        runs[label].append(harness.consume({
            **base, "system": "service", "target": server.target, "dataset": name,
            "client": s["client"], "tune_malloc": s.get("tune_malloc", False)}))
      for label in sockets:
        runs[label].append(harness.consume({
            **base, "system": "tcp", "tcp_port": tcp_port, "batch_bytes": step_bytes,
            "tcp_buffers": TCP_BUFFERS if label == rotating else 1}))
      harness.log(f"[{name} {key}] round {rnd + 1}/{rounds}, steps/s: " + ", ".join(
          f"{k} {v[-1]['records_per_s'] / base_spec['global_batch_size']:.1f}"
          for k, v in runs.items()))
  return {"rows": {k: _summary(v) for k, v in runs.items()}}


def best(rows: dict[str, Any]) -> str:
  """The label of the fastest tuned row (median GB/s)."""
  return max((k for k in rows if k.startswith(TUNED)), key=lambda k: rows[k]["median"])


def ratio(rows: dict[str, Any], label: str = "default") -> float:
  """`label`'s median GB/s over the best tuned row's."""
  return rows[label]["median"] / rows[best(rows)]["median"]


def _steps_per_s(row: dict[str, Any], block: dict[str, Any]) -> float:
  return row["records_per_s"] / block["global_batch_size"]


def best_table(report: dict[str, Any]) -> str:
  """Per workload and W: the default against the best of the sweep."""
  lines = ["| workload | W, server's pipeline | default, steps/s (GB/s) | best tuned | "
           "best tuned, steps/s (GB/s) | **default × best tuned** | plain TCP, GB/s | "
           "client CPU s / GB, default | client CPU s / GB, best tuned |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, blocks in report.items():
    for block in blocks.values():
      rows = block["rows"]
      label = best(rows)
      default, top = rows["default"], rows[label]
      name_ = f"{TUNED} best: {label.split(': ', 1)[-1]}"
      lines.append(
          f"| {name} | {block['workers']}, {block['pipeline']} | "
          f"{_steps_per_s(default, block):.1f} ({default['median']:.3g}) | {name_} | "
          f"{_steps_per_s(top, block):.1f} ({top['median']:.3g}) | "
          f"**{ratio(rows):.2f}** | {rows['plain TCP']['median']:.3g} | "
          f"{default['client_cpu_s_per_gb']:.3f} | {top['client_cpu_s_per_gb']:.3f} |")
  return "\n".join(lines)


def table(report: dict[str, Any]) -> str:
  """Every setting measured: the sweep's spread."""
  lines = ["| workload | W, server's pipeline | client | steps/s | GB/s (median, min–max) | "
           "× best tuned | × plain TCP | client CPU s / GB | window at the end (steps) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, blocks in report.items():
    for block in blocks.values():
      rows = block["rows"]
      top = rows[best(rows)]["median"]
      wire = rows["plain TCP"]["median"]
      for label, r in rows.items():
        windows = sorted({w for w in r["window"] if w is not None})
        window = "–".join(str(w) for w in (windows[:1] + windows[-1:] if len(windows) > 1
                                           else windows)) or "n/a"
        client = f"**{label}**" if label == "default" else label
        lines.append(f"| {name} | {block['workers']}, {block['pipeline']} | {client} | "
                     f"{_steps_per_s(r, block):.1f} | "
                     f"{r['median']:.3g} ({min(r['runs']):.3g}–{max(r['runs']):.3g}) | "
                     f"{r['median'] / top:.2f} | {r['median'] / wire:.2f} | "
                     f"{r['client_cpu_s_per_gb']:.3f} | {window} |")
  return "\n".join(lines)


def summary(report: dict[str, Any]) -> str:
  """The goal in one line per workload: default × best tuned at each W."""
  out = []
  for name, blocks in report.items():
    ratios = {key: ratio(b["rows"]) for key, b in blocks.items()}
    out.append(f"{name}: default × best tuned " + ", ".join(
        f"{k} {v:.2f}" for k, v in ratios.items()) +
        f" (goal ≥ {GOAL} at every W: {'met' if min(ratios.values()) >= GOAL else 'not met'})")
  return "\n".join(out)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.clients",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=str(pathlib.Path(tempfile.gettempdir()) / "elevator-bench"))
  p.add_argument("--workloads", default=",".join(WORKLOADS))
  p.add_argument("--workers", type=_ints, default=[2],
                 help="server sizes running the real pipeline (comma-separated)")
  p.add_argument("--sleeping-workers", type=_ints, default=[8, 16],
                 help="server sizes whose pipeline sleeps per record (comma-separated)")
  p.add_argument("--sleep-us-per-record", type=float, default=None,
                 help="the sleeping pipeline's wait per record (default: per workload, "
                 f"{sleeping.DEFAULT_SLEEP_US})")
  p.add_argument("--sweep-connections", type=_ints, default=list(SWEEP_CONNECTIONS_PER_WORKER),
                 help="connections per server worker swept (comma-separated; at most "
                 f"{MAX_SWEEP_CONNECTIONS} connections; not for text)")
  p.add_argument("--sweep-steps", type=_ints, default=[],
                 help="steps per request swept (comma-separated; default: per workload, "
                 f"1, that of {SWEEP_REQUEST_BYTES >> 20} MiB and between; text: {TEXT_STEPS})")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--warmup", type=float, default=1.0)
  p.add_argument("--records", type=int, default=None,
                 help="records per workload (default: the bench's)")
  p.add_argument("--glibc", action="store_true",
                 help="also each setting with glibc's allocator tunables (proto/malloc.py)")
  p.add_argument("--json", default=None)
  p.add_argument("--tcp-buffers", type=int, default=0,
                 help="also a plain TCP socket receiving into this many buffers in turn, as "
                 "a client's window does (tools/bench/tcp.py)")
  p.add_argument("--explore", default=None,
                 help='more settings, JSON: {"label": {"prefetch": 16, "transport": {...}, '
                 '"tune_malloc": false}}')
  a = p.parse_args(argv)
  unknown = sorted(set(a.workloads.split(",")) - set(WORKLOADS))
  if unknown:
    p.error(f"--workloads: no workload {', '.join(unknown)} (there are {', '.join(WORKLOADS)})")
  for flag, values in (("--sweep-connections", a.sweep_connections),
                       ("--sweep-steps", a.sweep_steps)):
    if any(v < 1 for v in values):
      p.error(f"{flag}: every value must be at least 1, got {values}")
  if not a.sweep_connections:
    p.error("--sweep-connections: at least one value")
  global TCP_BUFFERS
  TCP_BUFFERS = a.tcp_buffers
  if a.explore:
    EXPLORE.update(json.loads(a.explore))
  def save(report: dict[str, Any]) -> None:
    if a.json:
      pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
  report = run(pathlib.Path(a.data), a.workloads.split(","), a.workers, a.sleeping_workers,
               a.rounds, a.seconds, a.warmup, a.records, a.sleep_us_per_record, a.glibc, save,
               tuple(a.sweep_connections), tuple(a.sweep_steps))
  print(best_table(report))
  print()
  print(table(report))
  print()
  print(summary(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
