"""What mixing costs: a 3-way mixture against its components, in one run.

Three components over the bench's small shards (the same records, seeds 1, 2
and 3, each with the workload's batch_transform), and `mix` = their mixture
at 0.5/0.3/0.2. One `elevator serve` with its defaults (2 workers); a default
`RemoteDataset` reads each for `--seconds` in a fresh process, interleaved
over `--rounds`:

    python -m grain_elevator.tools.bench.mixture [--rounds 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools.testing.launcher import LocalServer

COMPONENTS = {"c1": 1, "c2": 2, "c3": 3}
WEIGHTS = {"c1": 0.5, "c2": 0.3, "c3": 0.2}
WARMUP_S = 1.0  # before each measured run


def write_config(data: pathlib.Path, records: int) -> tuple[str, workloads_lib.Workload]:
  w = workloads_lib.WORKLOADS["small"]
  workloads_lib.prepare(data, w, records)
  opts = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n"
                 for k, v in w.options.items())
  body = "".join(
      f'[datasets.{name}]\npaths = ["{w.name}/*.array_record"]\n'
      'pipeline = "grain_elevator.pipelines.examples:decode_images"\n'
      'batch_transform = "grain_elevator.pipelines.examples:decode_images_batch"\n'
      f"seed = {seed}\nnum_epochs = 0\n[datasets.{name}.options]\n{opts}\n"
      for name, seed in COMPONENTS.items())
  body += "[datasets.mix]\nmixture = { " + ", ".join(
      f"{k} = {v}" for k, v in WEIGHTS.items()) + " }\n"
  config = data / "mixture.toml"
  config.write_text(body)
  return str(config), w


def run(data: pathlib.Path, rounds: int, seconds: float, records: int,
        warmup_s: float = WARMUP_S) -> dict[str, list[float]]:
  config, w = write_config(data, records)
  workloads_lib.warm_page_cache(workloads_lib.shard_files(data, w))
  rates: dict[str, list[float]] = {n: [] for n in [*COMPONENTS, "mix"]}
  with LocalServer(config) as server:
    for rnd in range(rounds):
      for name in rates:
        r = harness.consume({
            "system": "service", "workload": w.name, "target": server.target,
            "dataset": name, "global_batch_size": w.global_batch_size,
            "seconds": seconds, "warmup_s": warmup_s, "client": {}})
        rates[name].append(r["records_per_s"])
      print(f"round {rnd + 1}/{rounds}: " + ", ".join(
          f"{k} {v[-1]:,.0f}" for k, v in rates.items()), file=sys.stderr, flush=True)
  return rates


def table(rates: dict[str, list[float]]) -> str:
  mean_component = statistics.mean(statistics.median(rates[n]) for n in COMPONENTS)
  lines = ["| dataset | records/s (median, min–max) | × mean of the components |",
           "|---|---|---|"]
  for name, runs in rates.items():
    label = f"{name} (mixture {', '.join(f'{k} {v}' for k, v in WEIGHTS.items())})" \
        if name == "mix" else f"{name} (component)"
    lines.append(f"| {label} | {statistics.median(runs):,.0f} "
                 f"({min(runs):,.0f}–{max(runs):,.0f}) | "
                 f"{statistics.median(runs) / mean_component:.2f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.mixture",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=str(pathlib.Path(tempfile.gettempdir()) / "elevator-bench"))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--warmup", type=float, default=WARMUP_S, help="warm-up seconds per run")
  p.add_argument("--records", type=int, default=workloads_lib.WORKLOADS["small"].default_records)
  a = p.parse_args(argv)
  print(table(run(pathlib.Path(a.data), a.rounds, a.seconds, a.records, a.warmup)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
