"""Two server builds against each other, interleaved, read by one client.

    python -m grain_elevator.tools.bench.versus OLD_ELEVATOR NEW_ELEVATOR [--rounds 2]
        [--kind auto|grpc] [--clients OLD_PYTHON NEW_PYTHON] [--workloads small,large]

OLD_ELEVATOR and NEW_ELEVATOR are `elevator` executables (e.g. one in a
virtualenv made from `git worktree add /tmp/old <commit>`). For each
workload (by default the benchmark's small and large, at 50,000 and 2,000
records; `--workloads` names others of tools/bench/workloads.py, at their
default record counts) and round, each build serves with 2 workers, alternating which goes first,
and a client reads for 8 s after 2 s of warm-up, with default
and with the benchmark's tuned settings. Prints the median steps/s of each
and their ratio. A server-side change is judged by this, on one machine in
one session, rather than by two separate benchmark runs.

`--kind grpc` reads over gRPC instead of the default transport choice.
`--old-name FROM=TO` (repeatable) serves the old build a copy of each config
with the module name FROM written TO: for a change that moved the
pipelines a config names (e.g. grain_elevator.pipelines.=grain_elevator.tools.).
Each measurement runs in a process of its own, by this Python, or with
`--clients` by each build's own Python (its client: a client-side change is
then part of the comparison).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

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


# One measurement, in a process of the build's own Python (its client): 2 s
# of warm-up, 8 s counted. Public API only, which every build has.
_MEASURE = """
import sys, time
from grain_elevator.client import RemoteDataset, TransportOptions
target, name, g, tuned, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
steps = {"small": 4, "costly": 2}.get(name, 3)
kwargs = ({"prefetch": 4 * steps, "transport": TransportOptions(
    kind=kind, steps_per_request=steps, connections_per_target=4)} if tuned
          else {"transport": TransportOptions(kind=kind)})
with RemoteDataset(target, name, g, **kwargs) as ds:
  it = iter(ds)
  start = time.monotonic()
  while time.monotonic() - start < 2:
    next(it)
  n, start = 0, time.monotonic()
  while time.monotonic() - start < 8:
    next(it)
    n += 1
  print(n / (time.monotonic() - start))
"""


def _steps_per_s_in(python: str, target: str, name: str, tuned: bool, kind: str) -> float:
  w = workloads.WORKLOADS[name]
  out = subprocess.run([python, "-c", _MEASURE, target, name, str(w.global_batch_size),
                        "1" if tuned else "0", kind],
                       check=True, capture_output=True, text=True).stdout
  return float(out.strip().splitlines()[-1])


def _renamed(config: str, name: str, renames: list[tuple[str, ...]]) -> str:
  """`config`, or a copy beside it (workload `name`'s) with each FROM written TO."""
  if not renames:
    return config
  text = pathlib.Path(config).read_text()
  for old, new in renames:
    text = text.replace(old, new)
  copy = pathlib.Path(config).with_name(f"old-build-{name}.toml")
  copy.write_text(text)
  return str(copy)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("old")
  parser.add_argument("new")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--data-dir", default=None, help="shards are kept here (default: temp)")
  parser.add_argument("--kind", choices=("auto", "grpc"), default="auto",
                      help="the client's transport (default: auto, bulk where offered)")
  parser.add_argument("--clients", nargs=2, metavar=("OLD_PYTHON", "NEW_PYTHON"),
                      help="measure each build with its own client, run by this Python")
  parser.add_argument("--workloads", default=",".join(RECORDS),
                      help=f"comma-separated, of {', '.join(workloads.WORKLOADS)}")
  parser.add_argument("--old-name", action="append", default=[], metavar="FROM=TO",
                      help="module name FROM is TO in the old build (a moved pipeline)")
  args = parser.parse_args()
  renames = [tuple(r.split("=", 1)) for r in args.old_name]
  names = [n for n in args.workloads.split(",") if n]
  unknown = [n for n in names if n not in workloads.WORKLOADS]
  if unknown or not names:
    parser.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(workloads.WORKLOADS)}")
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(args.data_dir or tmp)
    configs = {name: workloads.prepare(root, workloads.WORKLOADS[name], RECORDS.get(
        name, workloads.WORKLOADS[name].default_records)) for name in names}
    old_configs = {name: _renamed(config, name, renames) for name, config in configs.items()}
    got: dict[tuple[str, bool, str], list[float]] = {}
    for r in range(args.rounds):
      for name, config in configs.items():
        for build in (("old", "new") if r % 2 == 0 else ("new", "old")):
          proc, target = _serve(getattr(args, build),
                                config if build == "new" else old_configs[name])
          try:
            for tuned in (False, True):
              python = args.clients[0 if build == "old" else 1] if args.clients else sys.executable
              rate = _steps_per_s_in(python, target, name, tuned, args.kind)
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
