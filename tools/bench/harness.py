"""What every `elevator bench` workload shares: a system to measure, one
measurement in a process of its own (consume.py), interleaved rounds, and
median (min-max) summaries.

Systems are measured in turn, round after round, never all runs of one then
all of the next: this machine is shared and its speed drifts, and
interleaving spreads the drift over every system alike.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from typing import Any, Callable

CONSUME = [sys.executable, "-m", "grain_elevator.tools.bench.consume"]


@dataclasses.dataclass(frozen=True)
class System:
  """One thing measured: its id in the JSON, its row label, the spec that
  consume.py builds it from, and its kind (grain, embedded, service, tcp,
  floor, tfdata)."""

  key: str
  label: str
  spec: dict[str, Any]
  kind: str


def log(msg: str) -> None:
  """Progress, on stderr (stdout carries the tables)."""
  print(msg, file=sys.stderr, flush=True)


def consume(spec: dict[str, Any], *, python: str = sys.executable,
            label: str = "") -> dict[str, Any]:
  """One run of consume.py on `spec` (with its seconds and warmup_s) in a
  fresh process: its figures."""
  result = subprocess.run([python, *CONSUME[1:], json.dumps(spec)], capture_output=True,
                          text=True, timeout=300)
  if result.returncode != 0:
    raise RuntimeError(f"{label or spec.get('system')} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def measure(system: System, seconds: float, warmup_s: float) -> dict[str, Any]:
  """One run of `system`: its figures."""
  python = sys.executable
  if system.kind == "tfdata":  # TensorFlow's interpreter, which may be another one
    from grain_elevator.tools.bench import tfdata  # pylint: disable=g-import-not-at-top
    python = tfdata.python()
  return consume({**system.spec, "seconds": seconds, "warmup_s": warmup_s}, python=python,
                 label=system.label)


def interleaved(name: str, systems: list[System], repeats: int, seconds: float,
                warmup_s: float, *, before: Callable[[], None] = lambda: None,
                derive: Callable[[System, dict[str, Any]], dict[str, Any]] = lambda s, r: r,
                unit: str = "rec/s", figure: str = "records_per_s"
                ) -> dict[str, list[dict[str, Any]]]:
  """Every system `repeats` times, round after round: key -> its runs.
  `before` runs before each measurement (waiting for the machine to settle),
  `derive` adds figures to each run; `figure` (in `unit`) is logged."""
  raw: dict[str, list[dict[str, Any]]] = {s.key: [] for s in systems}
  done, total = 0, repeats * len(systems)
  for rep in range(repeats):
    for s in systems:
      before()
      r = derive(s, measure(s, seconds, warmup_s))
      raw[s.key].append(r)
      done += 1
      gb = f" {r['gb_per_s']:6.3f} GB/s" if unit == "rec/s" else ""
      log(f"[{name}] {done:3d}/{total} rep {rep + 1}: {s.label:<62} "
          f"{r[figure]:>10,.0f} {unit}{gb}")
  return raw


def summary(values: list[float | None]) -> dict[str, float] | None:
  """Median, min and max of the runs that measured it; None if none did."""
  vals = [v for v in values if v is not None]
  if not vals:
    return None
  return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def rows(systems: list[System], raw: dict[str, list[dict[str, Any]]],
         figures: tuple[str, ...]) -> dict[str, dict[str, Any]]:
  """The report's entry per system: label, kind, a summary per figure, the runs."""
  return {s.key: {"label": s.label, "kind": s.kind,
                  **{k: summary([r.get(k) for r in raw[s.key]]) for k in figures},
                  "runs": raw[s.key]} for s in systems}


def fmt(s: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
  """A summary as "median (min–max)"."""
  if s is None:
    return "n/a"
  f = f"{{:,.{digits}f}}"
  return (f"{f.format(s['median'] * scale)} ({f.format(s['min'] * scale)}–"
          f"{f.format(s['max'] * scale)})")
