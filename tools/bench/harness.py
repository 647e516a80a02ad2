"""What every `elevator bench` workload shares: a system to measure, one
measurement in a process of its own (consume.py), interleaved rounds, and
median (min-max) summaries.

Each measurement runs in a new process forked from a server process that
has only imported what consume.py needs (multiprocessing's forkserver): no
iterator, thread, cache or allocator state passes from one system to the
next, and no system pays the second or so of imports. A system measured
under another interpreter (tf.data's) is started as a process of its own.

Systems are measured in turn, round after round, never all runs of one then
all of the next: this machine is shared and its speed drifts, and
interleaving spreads the drift over every system alike.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import multiprocessing
import statistics
import subprocess
import sys
import traceback
from typing import Any, Callable

CONSUME = [sys.executable, "-m", "grain_elevator.tools.bench.consume"]
_TIMEOUT_S = 300
# What the fork server imports once, for every measurement forked from it.
_PRELOAD = ["numpy", "psutil", "grain", "grain_elevator.client",
            "grain_elevator.tools.bench.consume"]


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


@functools.cache
def forks() -> Any:
  """A fork server that imported the client and numpy once: a process
  started from it measures from its first step, not after ~2.5 s of imports."""
  context = multiprocessing.get_context("forkserver")
  context.set_forkserver_preload(_PRELOAD)
  return context


def _call_here(fn: Callable[[Any], Any], arg: Any, out: Any) -> None:
  """In the forked process: `fn(arg)`, or its traceback."""
  try:
    out.send(("ok", fn(arg)))
  except BaseException:  # pylint: disable=broad-except
    out.send(("error", traceback.format_exc()))
  out.close()
  # A forked process ends without the interpreter's exit handlers, which is
  # where Grain's mp_prefetch stops its workers and frees their shared memory.
  atexit._run_exitfuncs()  # pylint: disable=protected-access


def forked(fn: Callable[[Any], Any], arg: Any, name: str) -> Any:
  """`fn(arg)` (a module-level function) in a new process forked from the
  fork server; its result, or a RuntimeError with the child's traceback."""
  context = forks()
  receive, send = context.Pipe(duplex=False)
  proc = context.Process(target=_call_here, args=(fn, arg, send), name=f"bench {name}")
  proc.start()
  send.close()
  try:
    if not receive.poll(_TIMEOUT_S):
      raise RuntimeError(f"{name}: no result within {_TIMEOUT_S} s")
    status, value = receive.recv()
  except EOFError:
    proc.join(5)
    raise RuntimeError(f"{name} failed: its process exited with no result "
                       f"(exit code {proc.exitcode})") from None
  finally:
    if proc.is_alive():
      proc.kill()
    proc.join()
  if status != "ok":
    raise RuntimeError(f"{name} failed:\n{value[-3000:]}")
  return value


def consume(spec: dict[str, Any], *, python: str = sys.executable,
            label: str = "") -> dict[str, Any]:
  """One run of consume.py on `spec` (with its seconds and warmup_s) in a
  fresh process: its figures."""
  name = label or spec.get("system")
  if python == sys.executable:
    from grain_elevator.tools.bench import consume as consume_lib  # pylint: disable=g-import-not-at-top
    return forked(consume_lib.run, spec, name)
  result = subprocess.run([python, *CONSUME[1:], json.dumps(spec)], capture_output=True,
                          text=True, timeout=_TIMEOUT_S)
  if result.returncode != 0:
    raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
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


def against_local(unit: str, cpu: float, local_cpu: float, per_core: float,
                  local_per_core: float) -> str:
  """A service's two goals as ratios to the best local Grain: the trainer's
  CPU per `unit` (≤ 0.1×) and the `unit`s per server core (≥ 1×)."""
  return (f"trainer CPU per {unit} {cpu / local_cpu:.3f}× local Grain's (goal ≤ 0.1: "
          f"{'met' if cpu <= local_cpu / 10 else 'not met'}); {unit}s/s per server core "
          f"{per_core / local_per_core:.2f}× local Grain's per core (goal ≥ 1: "
          f"{'met' if per_core >= local_per_core else 'not met'})")
