"""Client settings side by side: a default `RemoteDataset` against tuned ones.

Users run defaults, so the default must be near the best hand-tuned setting.
One server per workload (W workers, `elevator serve`'s defaults), then each
client setting measured in a fresh process for `--seconds`, interleaved over
`--rounds`, with and without glibc's tunables (proto/malloc.py, which the
client no longer needs), next to a plain TCP socket moving the same bytes.
"× best tuned" divides by the faster of the two tuned rows:

    python -m grain_elevator.tools.bench.clients [--workloads small,large] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import portfile
from grain_elevator.tools.bench import run as run_lib
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.launcher import LocalServer



EXPLORE: dict[str, dict[str, Any]] = {}  # more label -> client settings (--explore)
TUNED = ("tuned (elevator bench's)", "tuned + glibc tunables")


def settings(w: workloads_lib.Workload, workers: int) -> dict[str, dict[str, Any]]:
  """label -> RemoteDataset arguments (plus "tune_malloc")."""
  tuned = run_lib.client_settings(w, workers)
  explore = {k: dict(v) for k, v in EXPLORE.items()}
  return {
      "default": {"client": {}},
      "default + glibc tunables": {"client": {}, "tune_malloc": True},
      **{k: {"client": v, "tune_malloc": v.pop("tune_malloc", False)}
         for k, v in explore.items()},
      TUNED[0]: {"client": tuned},
      TUNED[1]: {"client": tuned, "tune_malloc": True},
  }


def run(data: pathlib.Path, names: list[str], workers: int, rounds: int, seconds: float,
        warmup_s: float, records: int | None = None) -> dict[str, Any]:
  report: dict[str, Any] = {}
  for name in names:
    w = workloads_lib.WORKLOADS[name]
    config = workloads_lib.prepare(data, w, records or w.default_records)
    workloads_lib.warm_page_cache(workloads_lib.shard_files(data, w))
    batch = w.global_batch_size * w.delivered_bytes_per_record
    rows: dict[str, list[float]] = {k: [] for k in [*settings(w, workers), "plain TCP"]}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    port_file = data / f"clients-tcp-port-{name}"
    port_file.unlink(missing_ok=True)
    sender = subprocess.Popen([*run_lib.TCP, str(port_file), str(batch)])
    tcp_port = portfile.wait(port_file, sender, time.monotonic() + 30)
    with LocalServer(config, workers=workers) as server:
      base = {"workload": name, "global_batch_size": w.global_batch_size,
              "seconds": seconds, "warmup_s": warmup_s}
      for rnd in range(rounds):
        for label, s in settings(w, workers).items():
          spec = {**base, "system": "service", "target": server.target, "dataset": name,
                  "client": s["client"], "tune_malloc": s.get("tune_malloc", False)}
          r = harness.consume(spec)
          rows[label].append(r["gb_per_s"])
          cpu[label].append(r["client_cpu_s_per_gb"])
        r = harness.consume({**base, "system": "tcp", "tcp_port": tcp_port, "batch_bytes": batch})
        rows["plain TCP"].append(r["gb_per_s"])
        cpu["plain TCP"].append(r["client_cpu_s_per_gb"])
        print(f"[{name}] round {rnd + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1]:.2f}" for k, v in rows.items()), file=sys.stderr, flush=True)
    sender.kill()
    sender.wait()
    report[name] = {k: {"median": statistics.median(v), "runs": v,
                        "client_cpu_s_per_gb": statistics.median(cpu[k]),
                        "client_cpu_runs": cpu[k]} for k, v in rows.items()}
  return report


def table(report: dict[str, Any]) -> str:
  lines = ["| workload | client | GB/s (median, min–max) | × best tuned | × plain TCP "
           "| client CPU s / GB |", "|---|---|---|---|---|---|"]
  for name, rows in report.items():
    best = max(rows[k]["median"] for k in TUNED)
    wire = rows["plain TCP"]["median"]
    for label, r in rows.items():
      lines.append(f"| {name} | {label} | {r['median']:.2f} "
                   f"({min(r['runs']):.2f}–{max(r['runs']):.2f}) | "
                   f"{r['median'] / best:.2f} | {r['median'] / wire:.2f} | "
                   f"{r['client_cpu_s_per_gb']:.3f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.clients",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=str(pathlib.Path(tempfile.gettempdir()) / "elevator-bench"))
  p.add_argument("--workloads", default="small,large")
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--warmup", type=float, default=1.0)
  p.add_argument("--records", type=int, default=None,
                 help="records per workload (default: the bench's)")
  p.add_argument("--json", default=None)
  p.add_argument("--explore", default=None,
                 help='more settings, JSON: {"label": {"prefetch": 16, "transport": {...}, '
                 '"tune_malloc": false}}')
  a = p.parse_args(argv)
  if a.explore:
    EXPLORE.update(json.loads(a.explore))
  report = run(pathlib.Path(a.data), a.workloads.split(","), a.workers, a.rounds, a.seconds,
               a.warmup, a.records)
  print(table(report))
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
