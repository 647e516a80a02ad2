"""What sharing saves: server CPU for 1, 2 and 4 trainers reading one stream.

One `elevator serve` with its defaults (2 workers, the batch cache on) and
one with `--batch-cache-mb 0`, side by side. For each N in 1, 2, 4, N
default `RemoteDataset`s, each in a process of its own, read the same
`--steps` steps at once, from a step no earlier trial read; the server's CPU
is its processes' CPU seconds (/proc) over the trial. Every reader hashes
what it received, and the run fails unless all N hashes are equal: shared
steps must be the very bytes a lone reader gets.

    python -m grain_elevator.tools.bench.shared [--workload small] [--steps 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

READERS = (1, 2, 4)
# Trials start this many steps apart, so no trial finds another's steps cached.
_TRIAL_GAP = 100_000


def _read(target: str, dataset: str, g: int, start: int, steps: int, ready: Any,
          go: Any, out: Any) -> None:
  """One trainer: connects, waits for `go`, reads `steps` steps from
  `start`; puts (sha256 of every array's bytes, seconds)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  with RemoteDataset(target, dataset, g) as ds:
    it = iter(ds)
    state = it.get_state()
    state["step"] = start
    it.set_state(state)
    ready.put(1)
    go.wait(60)
    digest = hashlib.sha256()
    began = time.perf_counter()
    for _ in range(steps):
      batch = next(it)
      for key in sorted(batch):
        digest.update(np.ascontiguousarray(batch[key]).data)
    out.put((digest.hexdigest(), time.perf_counter() - began))


def _server_cpu_s(server: LocalServer) -> float:
  import psutil  # pylint: disable=g-import-not-at-top
  root = psutil.Process(server.proc.pid)
  total = 0.0
  for p in [root, *root.children(recursive=True)]:
    try:
      t = p.cpu_times()
      total += t.user + t.system
    except psutil.NoSuchProcess:
      pass
  return total


def trial(server: LocalServer, dataset: str, g: int, readers: int, start: int,
          steps: int) -> dict[str, float]:
  """N readers at once: the server's CPU seconds and the slowest reader's rate."""
  ctx = harness.forks()
  ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
  procs = [ctx.Process(target=_read, args=(server.target, dataset, g, start, steps,
                                           ready, go, out)) for _ in range(readers)]
  for p in procs:
    p.start()
  for _ in procs:
    ready.get(timeout=120)
  cpu0 = _server_cpu_s(server)
  go.set()
  results = [out.get(timeout=600) for _ in procs]
  cpu = _server_cpu_s(server) - cpu0
  for p in procs:
    p.join(30)
  digests = {d for d, _ in results}
  if len(digests) != 1:
    raise AssertionError(f"{readers} readers of one stream received different bytes")
  return {"server_cpu_s": cpu, "steps_per_s": steps / max(s for _, s in results)}


def run(data: pathlib.Path, workload: str, steps: int, rounds: int,
        records: int | None = None) -> dict[str, dict[int, list[dict[str, float]]]]:
  w = workloads_lib.WORKLOADS[workload]
  config = workloads_lib.prepare(data, w, records or w.default_records)
  workloads_lib.warm_page_cache(workloads_lib.shard_files(data, w))
  out: dict[str, dict[int, list[dict[str, float]]]] = {}
  settings = {"default (cache on)": [], "--batch-cache-mb 0": ["--batch-cache-mb", "0"]}
  servers = {label: LocalServer(config, workers=2, extra_args=args)
             for label, args in settings.items()}
  try:
    for label, server in servers.items():  # first requests pay for imports: not timed
      trial(server, w.name, w.global_batch_size, 1, 10 * _TRIAL_GAP, 5)
      out[label] = {n: [] for n in READERS}
    n_trial = 0
    for rnd in range(rounds):
      for n in READERS:
        for label, server in servers.items():
          n_trial += 1
          r = trial(server, w.name, w.global_batch_size, n, n_trial * _TRIAL_GAP, steps)
          out[label][n].append(r)
          print(f"round {rnd + 1}/{rounds} {label}, {n} readers: server "
                f"{r['server_cpu_s']:.2f} CPU-s, {r['steps_per_s']:.1f} steps/s each",
                file=sys.stderr, flush=True)
  finally:
    for server in servers.values():
      server.stop()
  return out


def table(results: dict[str, dict[int, list[dict[str, float]]]], steps: int) -> str:
  """Server CPU per trial (median of rounds) and × one reader's, per setting."""
  labels = list(results)
  head = "| readers | " + " | ".join(
      f"{lb}: server CPU-s (× 1 reader) | {lb}: steps/s each" for lb in labels) + " |"
  lines = [f"{steps} steps of the same stream per reader", head,
           "|---|" + "---|---|" * len(labels)]
  for n in READERS:
    cells = []
    for lb in labels:
      cpu = statistics.median(r["server_cpu_s"] for r in results[lb][n])
      one = statistics.median(r["server_cpu_s"] for r in results[lb][1])
      rate = statistics.median(r["steps_per_s"] for r in results[lb][n])
      cells += [f"{cpu:.2f} ({cpu / one:.2f}×)", f"{rate:.1f}"]
    lines.append(f"| {n} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.shared",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=str(pathlib.Path(tempfile.gettempdir()) / "elevator-bench"))
  p.add_argument("--workload", choices=sorted(workloads_lib.WORKLOADS), default="small")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--records", type=int, default=None,
                 help="records to write (default: the workload's)")
  a = p.parse_args(argv)
  results = run(pathlib.Path(a.data), a.workload, a.steps, a.rounds, a.records)
  print(table(results, a.steps))
  return 0


if __name__ == "__main__":
  sys.exit(main())
