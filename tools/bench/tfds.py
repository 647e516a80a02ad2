"""`elevator bench-tfds`: a TFDS dataset served by name, against TFDS's own
data source under local Grain, measured in one run.

The dataset is MNIST-shaped (28x28x1 PNG images, a label and an id; RECORDS
records by default, as many as MNIST's training split, in 8 ArrayRecord
shards), prepared by TFDS's own builder (tools/tfds_example.py). Two ways to
read it:

- decoded: the records as `tfds.data_source` gives them, batched. The
  service decodes whole batches (server/data/tfds_source.py); local Grain decodes
  one record per call, as TFDS does.
- augment: the same plus a per-record `random_map` (a random flip), so the
  service decodes record by record too.

Systems, each measured in a fresh process for `seconds` after `warmup_s`:
local Grain (`tfds.data_source` -> seed -> shuffle -> repeat -> [augment] ->
batch) with no read threads, Grain's default 16, and `mp_prefetch` with 2
processes; and the service (`elevator serve`, W workers, a default
`RemoteDataset`). The trainer's CPU is the consuming process's (and its
children's); the server's is its whole process tree over the same window.

    python -m grain_elevator.tools.bench.tfds [--records N] [--seconds S] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable

NAME = "elevator_mnist_like"
SIDE = 28
GLOBAL_BATCH = 256
RECORDS = 60_000
GRAIN_SETTINGS = {  # label -> (read threads, mp_prefetch processes)
    "threads=0": (0, 0),
    "threads=16 (default)": (16, 0),
    "mp_prefetch(2)": (0, 2),
}


def prepare(root: pathlib.Path, num_records: int) -> str:
  """Writes the dataset (unless present) and a config; returns its path."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools import tfds_example  # pylint: disable=g-import-not-at-top
  marker = root / f".complete-{num_records}"
  if not marker.exists():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, num_records)
    # Digit-like: a fixed template a class plus noise, so PNGs compress as MNIST's do.
    templates = (rng.random((10, SIDE, SIDE, 1)) > 0.7) * 255
    noise = rng.integers(-40, 40, (num_records, SIDE, SIDE, 1))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    print(f"writing {num_records:,} MNIST-shaped PNG records as a TFDS dataset in {root}",
          flush=True)
    tfds_example.write_tfds_dataset(str(root / "tfds"), NAME, {"train": (images, labels)},
                                    num_classes=10, shards_per_split=8)
    marker.touch()
  config = root / "elevator.toml"
  config.write_text(textwrap.dedent(f"""\
      [datasets.decoded]
      tfds = "{NAME}"
      data_dir = "tfds"
      seed = 1
      num_epochs = 0

      [datasets.augment]
      tfds = "{NAME}"
      data_dir = "tfds"
      seed = 1
      num_epochs = 0
      pipeline = "grain_elevator.tools.tfds_example:augment"
      """))
  return str(config)


def _grain_local(spec: dict[str, Any]) -> Callable[[], Any]:
  import grain  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools import tfds_example  # pylint: disable=g-import-not-at-top
  flags.FLAGS.mark_as_parsed()

  def make():
    source = tfds.data_source(NAME, split="train", data_dir=spec["data_dir"], download=False)
    ds = grain.MapDataset.source(source).seed(1).shuffle().repeat(None)
    if spec["dataset"] == "augment":
      ds = tfds_example.augment(ds)
    ds = ds.batch(GLOBAL_BATCH)
    threads = spec["threads"]
    it_ds = ds.to_iter_dataset(grain.ReadOptions(
        num_threads=threads, prefetch_buffer_size=2 * threads if threads else 0))
    if spec["mp_workers"]:
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec["mp_workers"]))
    return iter(it_ds)
  return make


def _service(spec: dict[str, Any]) -> Callable[[], Any]:
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  return lambda: iter(RemoteDataset(spec["target"], spec["dataset"], GLOBAL_BATCH))


def measure(spec: dict[str, Any]) -> dict[str, Any]:
  """One system, in this process: records/s and CPU per 1,000 records."""
  import psutil  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.bench.consume import tree_cpu  # pylint: disable=g-import-not-at-top
  make = _grain_local(spec) if spec["system"] == "grain" else _service(spec)
  me = psutil.Process()
  server = psutil.Process(spec["server_pid"]) if spec.get("server_pid") else None
  it = make()
  next(it)
  deadline = time.perf_counter() + spec["warmup_s"]
  while time.perf_counter() < deadline:
    next(it)
  cpu0, server0, t0 = tree_cpu(me), tree_cpu(server) if server else 0.0, time.perf_counter()
  batches = 0
  while time.perf_counter() - t0 < spec["seconds"]:
    next(it)
    batches += 1
  wall = time.perf_counter() - t0
  records = batches * GLOBAL_BATCH
  out = {"records_per_s": records / wall,
         "trainer_cpu_s_per_1k": (tree_cpu(me) - cpu0) / records * 1000}
  if server:
    out["server_cpu_s_per_1k"] = (tree_cpu(server) - server0) / records * 1000
  close = getattr(it, "close", None)
  if close:
    close()
  return out


def _run_measure(spec: dict[str, Any]) -> dict[str, Any]:
  from grain_elevator.tools.bench import harness  # pylint: disable=g-import-not-at-top
  return harness.forked(measure, spec, f"{spec['system']} on {spec.get('dataset', '')}")


def run(data: str | None, records: int, workers: int, seconds: float, warmup_s: float,
        repeats: int) -> dict[str, Any]:
  """Every system on both datasets, interleaved `repeats` times; medians."""
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(data or os.path.join(tempfile.gettempdir(), "grain-elevator-bench-tfds"))
  root.mkdir(parents=True, exist_ok=True)
  config = prepare(root, records)
  data_dir = str(root / "tfds")
  results: dict[str, dict[str, list[dict[str, Any]]]] = {}
  with LocalServer(config, workers=workers) as server:
    for _ in range(repeats):
      for dataset in ("decoded", "augment"):
        runs = results.setdefault(dataset, {})
        for label, (threads, mp) in GRAIN_SETTINGS.items():
          runs.setdefault(f"local Grain, {label}", []).append(_run_measure({
              "system": "grain", "dataset": dataset, "data_dir": data_dir,
              "threads": threads, "mp_workers": mp, "seconds": seconds,
              "warmup_s": warmup_s}))
        runs.setdefault(f"service, defaults ({workers} workers)", []).append(_run_measure({
            "system": "service", "dataset": dataset, "target": server.target,
            "server_pid": server.proc.pid, "seconds": seconds, "warmup_s": warmup_s}))
        print(f"  {dataset}: round done", flush=True)
  return {"records": records, "workers": workers, "global_batch_size": GLOBAL_BATCH,
          "seconds": seconds, "repeats": repeats,
          "results": {d: {s: _median(r) for s, r in runs.items()}
                      for d, runs in results.items()}}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
  keys = runs[0].keys()
  return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in keys} | {
      "runs_records_per_s": [round(r["records_per_s"]) for r in runs]}


def table(report: dict[str, Any]) -> str:
  lines = [f"TFDS dataset by name: {report['records']:,} MNIST-shaped PNG records, "
           f"G={report['global_batch_size']}, medians of {report['repeats']} interleaved "
           f"rounds of {report['seconds']:g} s", "",
           "| read | system | records/s | x best local Grain | trainer CPU s / 1k records "
           "| server CPU s / 1k records |", "|---|---|---|---|---|---|"]
  for dataset, systems in report["results"].items():
    best = max(m["records_per_s"] for s, m in systems.items() if s.startswith("local"))
    for system, m in systems.items():
      server = m.get("server_cpu_s_per_1k")
      lines.append(
          f"| {dataset} | {system} | {m['records_per_s']:,.0f} | "
          f"{m['records_per_s'] / best:.2f}x | {m['trainer_cpu_s_per_1k']:.3f} | "
          f"{'' if server is None else f'{server:.3f}'} |")
  return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The options, for `elevator bench-tfds` and `python -m` alike."""
  p.add_argument("--data", default=None, help="folder for the dataset (default: a temp "
                                              "folder, reused across runs)")
  p.add_argument("--records", type=int, default=RECORDS, help=f"records (default {RECORDS:,})")
  p.add_argument("--workers", type=int, default=2, help="server worker processes")
  p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
  p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run")
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--json", default=None, help="also write the results here")


def run_from_args(a: argparse.Namespace) -> int:
  report = run(a.data, a.records, a.workers, a.seconds, a.warmup, a.repeats)
  print(table(report))
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.json}")
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["measure"]:
    print(json.dumps(measure(json.loads(argv[1]))), flush=True)
    return 0
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.tfds",
                              description=__doc__.split("\n\n")[0])
  add_arguments(p)
  return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
