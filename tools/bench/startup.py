"""How long a worker takes to start: builds against each other, interleaved.

    python -m grain_elevator.tools.bench.startup CONFIG PYTHON [PYTHON ...] [--rounds N]

For each build (the Python of its environment), in turn, round after round:
`elevator serve --workers 2` from launch to its ready line, and a SIGKILLed
worker's restart, from the supervisor's "restarting it in Ds" to its "is
serving again", less the backoff D (both log lines' timestamps). Medians
(min-max) per build; figures in BENCHMARKS.md ("Starting a worker")."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Sequence

# Run by each build's Python, so that it measures that build's code.
_DRIVER = r'''
import datetime, json, os, re, signal, sys, time
import psutil
from grain_elevator.tools.testing.launcher import LocalServer

def stamp(line):
  return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

def is_worker(p):  # named by lifeline.py, or spawned by a build before it
  return p.name().startswith("elevator-w") or "spawn_main" in " ".join(p.cmdline())

t = time.perf_counter()
server = LocalServer(sys.argv[1], workers=2)
start_s = time.perf_counter() - t
try:
  family = psutil.Process(server.proc.pid).children(recursive=True)
  os.kill([p for p in family if is_worker(p)][0].pid, signal.SIGKILL)
  deadline = time.monotonic() + 300
  while "is serving again" not in server.stderr():
    if time.monotonic() > deadline:
      sys.exit("no restart within 300 s:\n" + server.stderr())
    time.sleep(0.02)
  lines = server.stderr().splitlines()
  died = next(l for l in lines if "restarting it in" in l)
  back = next(l for l in lines if "is serving again" in l)
  delay = float(re.search(r"restarting it in ([\d.]+)s", died).group(1))
finally:
  server.stop()
print(json.dumps({"start_s": start_s, "restart_s": stamp(back) - stamp(died) - delay}))
'''


def measure(config: str, python: str) -> dict[str, float]:
  """One start and one restart with `python`'s build."""
  done = subprocess.run([python, "-c", _DRIVER, config], capture_output=True, text=True,
                        timeout=900)
  if done.returncode:
    raise RuntimeError(f"{python}: {done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("config", help="an elevator.toml")
  parser.add_argument("pythons", nargs="+", help="each build's Python")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args(argv)
  runs: dict[str, list[dict[str, float]]] = {p: [] for p in args.pythons}
  for r in range(args.rounds):
    for python in args.pythons:
      runs[python].append(measure(args.config, python))
      print(f"round {r + 1}/{args.rounds} {python}: start "
            f"{runs[python][-1]['start_s']:.2f} s, restart {runs[python][-1]['restart_s']:.2f} s",
            file=sys.stderr, flush=True)
  print("| build | `serve --workers 2` to ready, s | a worker's restart, s |")
  print("|---|---|---|")
  for python, rows in runs.items():
    cells = []
    for key in ("start_s", "restart_s"):
      values = [row[key] for row in rows]
      cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})")
    print(f"| {python} | {cells[0]} | {cells[1]} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
