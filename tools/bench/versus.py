"""Two server builds against each other, interleaved, read by one client.

    python -m grain_elevator.tools.bench.versus OLD_ELEVATOR NEW_ELEVATOR [--rounds 2]

OLD_ELEVATOR and NEW_ELEVATOR are `elevator` executables (e.g. one in a
virtualenv made from `git worktree add /tmp/old <commit>`). For each
workload (the benchmark's small and large, at 50,000 and 2,000 records)
and round, each build serves with 2 workers, alternating which goes first,
and this process's client reads for 8 s after 2 s of warm-up, with default
and with the benchmark's tuned settings. Prints the median steps/s of each
and their ratio. A server-side change is judged by this, on one machine in
one session, rather than by two separate benchmark runs.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import subprocess
import tempfile
import time

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.tools.bench import workloads

RECORDS = {"small": 50_000, "large": 2_000}


def _serve(elevator: str, config: str) -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen([elevator, "serve", "--config", config, "--port", "0",
                           "--workers", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  assert proc.stdout is not None
  for line in proc.stdout:
    m = re.search(r"on (\S+):(\d+) with", line)
    if m:
      return proc, f"{m.group(1)}:{m.group(2)}"
  raise RuntimeError(f"{elevator} exited without serving")


def _steps_per_s(target: str, name: str, tuned: bool, seconds: float = 8.0) -> float:
  w = workloads.WORKLOADS[name]
  kwargs = {}
  if tuned:
    steps = 4 if name == "small" else 3
    kwargs = {"prefetch": 4 * steps, "transport": TransportOptions(
        steps_per_request=steps, connections_per_target=4)}
  with RemoteDataset(target, name, w.global_batch_size, **kwargs) as ds:
    it = iter(ds)
    start = time.monotonic()
    while time.monotonic() - start < 2:
      next(it)
    n, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
      next(it)
      n += 1
    return n / (time.monotonic() - start)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("old")
  parser.add_argument("new")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--data-dir", default=None, help="shards are kept here (default: temp)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(args.data_dir or tmp)
    configs = {name: workloads.prepare(root, workloads.WORKLOADS[name], n)
               for name, n in RECORDS.items()}
    got: dict[tuple[str, bool, str], list[float]] = {}
    for r in range(args.rounds):
      for name, config in configs.items():
        for build in (("old", "new") if r % 2 == 0 else ("new", "old")):
          proc, target = _serve(getattr(args, build), config)
          try:
            for tuned in (False, True):
              rate = _steps_per_s(target, name, tuned)
              got.setdefault((name, tuned, build), []).append(rate)
              print(f"round {r} {name} {'tuned' if tuned else 'default'} {build}: "
                    f"{rate:.1f} steps/s", flush=True)
          finally:
            proc.terminate()
            proc.wait()
  print(f"\n{'workload':<9}{'client':<9}{'old':>9}{'new':>9}{'new/old':>9}")
  for name in configs:
    for tuned in (False, True):
      old = statistics.median(got[(name, tuned, "old")])
      new = statistics.median(got[(name, tuned, "new")])
      print(f"{name:<9}{'tuned' if tuned else 'default':<9}{old:>9.1f}{new:>9.1f}"
            f"{new / old:>9.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
