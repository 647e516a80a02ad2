"""Client settings side by side: a default `RemoteDataset` against tuned ones,
at several server sizes.

Users run defaults, so the default must be near the best hand-tuned setting
whatever the server's worker count W. For each workload (small, large,
image, text) and each W: one server (`elevator serve`'s defaults but W, and
no batch cache, which would serve a setting the steps an earlier one made),
then each client setting measured in a fresh process for `--seconds`,
interleaved over `--rounds`, next to a plain TCP socket moving the same
bytes. "× best tuned" divides by the fastest tuned row of the same W.

At `--workers` the server runs the workload's real pipeline. At
`--sleeping-workers` its pipeline waits `--sleep-us-per-record` per record
instead of computing (tools/bench/sleeping.py): W busy workers, as W real
cores would give, on a machine with fewer, so that how many requests a
client keeps in flight decides the rate:

    python -m grain_elevator.tools.bench.clients [--workloads small,large,image,text] \\
        [--workers 2] [--sleeping-workers 8,16] [--rounds 3]
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
from typing import Any, Callable

from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images as images_bench
from grain_elevator.tools.bench import portfile
from grain_elevator.tools.bench import run as run_lib
from grain_elevator.tools.bench import sleeping
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

EXPLORE: dict[str, dict[str, Any]] = {}  # more label -> client settings (--explore)
WORKLOADS = ("small", "large", "image", "text")
TUNED = "tuned"  # the rows "× best tuned" divides by: their labels start so


def tuned_settings(name: str, workers: int) -> dict[str, dict[str, Any]]:
  """label -> the hand-tuned RemoteDataset arguments the bench uses for
  workload `name` on W workers (run.py, images.py), and for text (a
  stream: one request at a time) longer and shorter requests."""
  if name == "text":
    return {f"{TUNED}: 64 steps a request, 256 ahead": {
                "prefetch": 256, "transport": {"steps_per_request": 64}},
            f"{TUNED}: 8 steps a request, 64 ahead": {
                "prefetch": 64, "transport": {"steps_per_request": 8}}}
  if name == "image":
    return {f"{TUNED} (elevator bench's)": images_bench.client_settings(workers)}
  return {f"{TUNED} (elevator bench's)":
          run_lib.client_settings(workloads_lib.WORKLOADS[name], workers)}


def settings(name: str, workers: int, glibc: bool = False) -> dict[str, dict[str, Any]]:
  """label -> RemoteDataset arguments (plus "tune_malloc")."""
  out: dict[str, dict[str, Any]] = {"default": {"client": {}}}
  if glibc:
    out["default + glibc tunables"] = {"client": {}, "tune_malloc": True}
  for label, client in EXPLORE.items():
    client = dict(client)
    out[label] = {"client": client, "tune_malloc": client.pop("tune_malloc", False)}
  for label, client in tuned_settings(name, workers).items():
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
        save: Callable[[dict[str, Any]], None] = lambda report: None) -> dict[str, Any]:
  """report[workload]["W=n"]: the server's pipeline and each setting's runs;
  `save(report)` after each block, so a run cut short keeps what it measured."""
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
                                   settings(name, wk, glibc), base_spec, tcp_port, step_bytes,
                                   rounds, seconds, warmup_s)
        report[name][key].update(workers=wk, pipeline=f"sleeping {us:g} µs/record" if slow
                                 else "real")
        save(report)
    finally:
      sender.kill()
      sender.wait()
  return report


def _block(name: str, key: str, server: LocalServer, systems: dict[str, dict[str, Any]],
           base_spec: dict[str, Any], tcp_port: int, step_bytes: int, rounds: int,
           seconds: float, warmup_s: float) -> dict[str, Any]:
  """Every setting against one server, and plain TCP, `rounds` times interleaved."""
  runs: dict[str, list[dict[str, Any]]] = {k: [] for k in [*systems, "plain TCP"]}
  base = {"workload": name, **base_spec, "seconds": seconds, "warmup_s": warmup_s}
  with server:
    for rnd in range(rounds):
      for label, s in systems.items():
        runs[label].append(harness.consume({
            **base, "system": "service", "target": server.target, "dataset": name,
            "client": s["client"], "tune_malloc": s.get("tune_malloc", False)}))
      runs["plain TCP"].append(harness.consume({
          **base, "system": "tcp", "tcp_port": tcp_port, "batch_bytes": step_bytes}))
      harness.log(f"[{name} {key}] round {rnd + 1}/{rounds}: " + ", ".join(
          f"{k} {v[-1]['gb_per_s']:.2f}" for k, v in runs.items()))
  return {"rows": {k: _summary(v) for k, v in runs.items()}}


def ratio(rows: dict[str, Any], label: str = "default") -> float:
  """`label`'s median GB/s over the best tuned row's."""
  return rows[label]["median"] / max(r["median"] for k, r in rows.items()
                                     if k.startswith(TUNED))


def table(report: dict[str, Any]) -> str:
  lines = ["| workload | W, server's pipeline | client | GB/s (median, min–max) | × best "
           "tuned | × plain TCP | client CPU s / GB | window at the end (steps) |",
           "|---|---|---|---|---|---|---|---|"]
  for name, blocks in report.items():
    for key, block in blocks.items():
      rows = block["rows"]
      best = max(r["median"] for k, r in rows.items() if k.startswith(TUNED))
      wire = rows["plain TCP"]["median"]
      for label, r in rows.items():
        windows = sorted({w for w in r["window"] if w is not None})
        window = "–".join(str(w) for w in (windows[:1] + windows[-1:] if len(windows) > 1
                                           else windows)) or "n/a"
        client = f"**{label}**" if label == "default" else label
        lines.append(f"| {name} | {block['workers']}, {block['pipeline']} | {client} | "
                     f"{r['median']:.3f} ({min(r['runs']):.3f}–{max(r['runs']):.3f}) | "
                     f"{r['median'] / best:.2f} | {r['median'] / wire:.2f} | "
                     f"{r['client_cpu_s_per_gb']:.3f} | {window} |")
  return "\n".join(lines)


def summary(report: dict[str, Any]) -> str:
  """The goal in one line per workload: default × best tuned at each W."""
  out = []
  for name, blocks in report.items():
    ratios = {key: ratio(b["rows"]) for key, b in blocks.items()}
    out.append(f"{name}: default × best tuned " + ", ".join(
        f"{k} {v:.2f}" for k, v in ratios.items()) +
        f" (goal ≥ 0.9: {'met' if min(ratios.values()) >= 0.9 else 'not met'})")
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
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--warmup", type=float, default=1.0)
  p.add_argument("--records", type=int, default=None,
                 help="records per workload (default: the bench's)")
  p.add_argument("--glibc", action="store_true",
                 help="also each setting with glibc's allocator tunables (proto/malloc.py)")
  p.add_argument("--json", default=None)
  p.add_argument("--explore", default=None,
                 help='more settings, JSON: {"label": {"prefetch": 16, "transport": {...}, '
                 '"tune_malloc": false}}')
  a = p.parse_args(argv)
  if a.explore:
    EXPLORE.update(json.loads(a.explore))
  def save(report: dict[str, Any]) -> None:
    if a.json:
      pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
  report = run(pathlib.Path(a.data), a.workloads.split(","), a.workers, a.sleeping_workers,
               a.rounds, a.seconds, a.warmup, a.records, a.sleep_us_per_record, a.glibc, save)
  print(table(report))
  print()
  print(summary(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
