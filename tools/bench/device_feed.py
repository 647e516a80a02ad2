"""`elevator bench-feed --device`: does a GPU get batches at the page-locked rate?

One server (the large workload: 4.9 MB batches of uint8 pixels), then on the
first GPU:

- the limit: a batch-sized copy to the device from page-locked numpy
  (`jax.device_put`; torch's pinned `.to("cuda", non_blocking=True)`), and
  from ordinary memory for comparison;
- the service through `to_device`'s stages and through `TorchLoader`'s copy
  step, each receiving into page-locked memory as they do by default on a
  GPU (client/transport/host_memory.py): host-to-device time per batch and
  GB/s, as a multiple of the limit's (goal: <= 1.25x);
- the data-stall fraction of a loop with a 10 ms step (a jitted or torch
  reduction, then the host sleeps out the step) over `to_device` and over
  `TorchLoader`, beside the rate the tier delivers to the host alone (goal:
  < 1% whenever that rate beats the step);
- bit-exactness: the first batches through both paths against embedded mode.

Without a GPU it says so, skips the GPU rows and still checks exactness on
the CPU. Made to finish in under 4 minutes on one GPU:

    elevator bench-feed --device [--records 1000] [--steps 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import feed
from grain_elevator.tools.bench import workloads

EXACT_STEPS = 8  # batches compared with embedded mode, per path
RECORDS = defaults.DEVICE_RECORDS  # of the large workload
COPY_REPEATS = 20  # copies timed for each limit (median)


def _median_s(fn: Callable[[], Any], repeats: int = COPY_REPEATS) -> float:
  fn()  # warm: allocation, first-call costs
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _gpus(jax: Any) -> list[Any]:
  return [d for d in jax.devices() if d.platform == "gpu"]


def _torch() -> Any | None:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return torch


def _tree_bytes(batch: Any) -> int:
  return sum(int(np.asarray(x).nbytes) for x in batch.values())


# -- the limits ----------------------------------------------------------------

def jax_copy_limits(nbytes: int, device: Any) -> dict[str, float]:
  """Seconds per batch-sized `jax.device_put` from page-locked and from
  ordinary numpy (uint8)."""
  import jax  # pylint: disable=g-import-not-at-top
  from grain_elevator.client.transport import host_memory  # pylint: disable=g-import-not-at-top
  memory = host_memory.cuda_host_memory() or host_memory.torch_pinned_memory()
  out: dict[str, Any] = {}
  pageable = np.ones(nbytes, dtype=np.uint8)
  out["pageable_s"] = _median_s(lambda: jax.block_until_ready(jax.device_put(pageable, device)))
  if memory is not None:
    locked = memory.allocate(nbytes)
    locked[:] = 1
    out["page_locked_s"] = _median_s(
        lambda: jax.block_until_ready(jax.device_put(locked, device)))
    out["page_locked_by"] = memory.name
  return out


def torch_copy_limits(nbytes: int) -> dict[str, float]:
  """Seconds per batch-sized copy to "cuda" from pinned and from ordinary memory."""
  torch = _torch()
  pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
  pageable = torch.ones(nbytes, dtype=torch.uint8)

  def copy(t: Any, non_blocking: bool) -> None:
    t.to("cuda", non_blocking=non_blocking)
    torch.cuda.synchronize()

  return {"page_locked_s": _median_s(lambda: copy(pinned, True)),
          "pageable_s": _median_s(lambda: copy(pageable, False))}


# -- the service -----------------------------------------------------------------

def host_rate(make: Callable[[], Any], steps: int) -> float:
  """Steps/s the tier delivers to the host alone (nothing else to do)."""
  it = iter(make())
  for _ in range(5):
    next(it)
  t = time.perf_counter()
  for _ in range(steps):
    next(it)
  rate = steps / (time.perf_counter() - t)
  _close(it)
  return rate


def via_to_device(make: Callable[[], Any], device: Any, steps: int, step_s: float
                  ) -> dict[str, Any]:
  """`to_device`'s stages (host read-ahead, put, device buffer) on one device,
  the put timed; the remote dataset receives into page-locked memory as
  `to_device` has it do."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import SingleDeviceSharding  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import device as device_lib  # pylint: disable=g-import-not-at-top
  from grain_elevator.client.transport import host_memory  # pylint: disable=g-import-not-at-top
  remote = make()
  sharding = SingleDeviceSharding(device)
  device_lib.receive_page_locked(remote, host_memory.for_platforms([device.platform]))
  clock = feed.TransferClock()
  it = iter(device_lib.buffered_put(
      remote, clock.timed_put(device_lib.PutOnMesh(sharding, None)), 4, 2))
  r = feed.training_loop(it, steps, step_s)
  _close(it)
  remote.close()
  memory = remote.host_memory
  return {**r, "transfer_s": clock.seconds / clock.count,
          "h2d_gb_per_s": clock.nbytes / clock.seconds / 1e9,
          "received_into": memory.name if memory is not None else "pageable"}


def via_torch_loader(make: Callable[[], Any], steps: int, step_s: float) -> dict[str, Any]:
  """TorchLoader(device="cuda"): its copy step timed on host batches the way
  the loader makes them (its own dataset receiving into torch's pinned
  memory), then the loader itself in a loop with a `step_s` step."""
  torch = _torch()
  from grain_elevator.client import torch as torch_lib  # pylint: disable=g-import-not-at-top
  remote = make()
  loader = torch_lib.TorchLoader(remote, device="cuda")  # picks pinned receive buffers
  copy = torch_lib._ToDevice(torch.device("cuda"), False)  # pylint: disable=protected-access
  host = iter(remote.map(torch_lib.to_tensors))
  times, nbytes = [], 0
  for k in range(min(steps, 100) + 3):
    batch = next(host)
    t = time.perf_counter()
    _, done = copy(batch)
    done.synchronize()
    if k >= 3:  # warm
      times.append(time.perf_counter() - t)
      nbytes += sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
  pinned = all(v.is_pinned() for v in batch.values() if isinstance(v, torch.Tensor))
  _close(host)

  def touch(b: Any) -> None:
    sum(v.float().sum() for v in b.values() if isinstance(v, torch.Tensor))
    torch.cuda.synchronize()

  it = iter(loader)
  for _ in range(5):
    touch(next(it))
  wait, t0 = 0.0, time.perf_counter()
  for _ in range(steps):
    t = time.perf_counter()
    b = next(it)
    wait += time.perf_counter() - t
    start = time.perf_counter()
    touch(b)
    remaining = step_s - (time.perf_counter() - start)
    if remaining > 0:
      time.sleep(remaining)
  wall = time.perf_counter() - t0
  _close(it)
  remote.close()
  return {"stall_fraction": wait / wall, "steps_per_s": steps / wall,
          "transfer_s": statistics.median(times),
          "h2d_gb_per_s": nbytes / sum(times) / 1e9, "received_pinned": pinned}


# -- exactness -------------------------------------------------------------------

def exactness(make: Callable[[], Any], embedded: Callable[[], Any], device: Any,
              torch_device: str | None) -> dict[str, bool]:
  """The first EXACT_STEPS batches through `to_device` (on `device`) and
  through TorchLoader (on `torch_device`, when torch is installed), byte for
  byte against embedded mode's."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import SingleDeviceSharding  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import to_device  # pylint: disable=g-import-not-at-top
  with embedded() as ds:
    it = iter(ds)
    want = [next(it) for _ in range(EXACT_STEPS)]
    _close(it)

  def same(got: dict[str, Any], expected: dict[str, np.ndarray]) -> bool:
    return all(np.asarray(got[k]).dtype == v.dtype and np.asarray(got[k]).tobytes() == v.tobytes()
               for k, v in expected.items())

  out = {}
  with make() as remote:
    it = iter(to_device(remote, SingleDeviceSharding(device)))
    out["to_device"] = all([same(jax.device_get(next(it)), w) for w in want])
    _close(it)
  torch = _torch()
  if torch is not None and torch_device is not None:
    from grain_elevator.client.torch import TorchLoader  # pylint: disable=g-import-not-at-top
    with make() as remote:
      it = iter(TorchLoader(remote, device=torch_device))
      out["TorchLoader"] = all([same({k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v
                                      for k, v in next(it).items()}, w) for w in want])
      _close(it)
  return out


def _close(it: Any) -> None:
  close = getattr(it, "close", None)
  if close is not None:
    close()


# -- the check -------------------------------------------------------------------

def run(*, data: pathlib.Path, records: int, workers: int, steps: int,
        step_ms: float) -> dict[str, Any]:
  """Everything above, as one report (see the module's docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_enable_x64", True)  # int64 leaves stay int64: exact
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  w = workloads.WORKLOADS["large"]
  config = workloads.prepare(data, w, records)
  workloads.warm_page_cache(workloads.shard_files(data, w))
  g, batch_bytes = w.global_batch_size, w.global_batch_size * w.delivered_bytes_per_record
  gpus = _gpus(jax)
  torch = _torch()
  torch_cuda = bool(torch is not None and torch.cuda.is_available())
  report: dict[str, Any] = {
      "workload": w.name, "global_batch_size": g, "batch_bytes": batch_bytes,
      "steps": steps, "step_ms": step_ms,
      "gpu": str(gpus[0].device_kind) if gpus else None, "torch_cuda": torch_cuda}
  with LocalServer(config, workers=workers) as server:
    def make() -> Any:
      return RemoteDataset(server.target, w.name, g)

    def embedded() -> Any:
      return RemoteDataset.embedded(config, w.name, g)

    device = gpus[0] if gpus else jax.devices()[0]
    report["exact"] = exactness(make, embedded, device,
                                "cuda" if torch_cuda else "cpu" if torch else None)
    report["host_steps_per_s"] = host_rate(make, steps)
    if gpus:
      report["jax_limit"] = jax_copy_limits(batch_bytes, device)
      report["to_device"] = via_to_device(make, device, steps, step_ms / 1e3)
    if torch_cuda:
      report["torch_limit"] = torch_copy_limits(batch_bytes)
      report["TorchLoader"] = via_torch_loader(make, steps, step_ms / 1e3)
  return report


def table(r: dict[str, Any]) -> str:
  """The report as the rows BENCHMARKS.md quotes."""
  mb = r["batch_bytes"] / 1e6
  lines = [f"{r['workload']} workload, G={r['global_batch_size']}, {mb:.1f} MB batches; "
           f"the tier delivers {r['host_steps_per_s']:.0f} steps/s to the host "
           f"({'faster' if r['host_steps_per_s'] > 1e3 / r['step_ms'] else 'slower'} than "
           f"a {r['step_ms']:g} ms step)"]
  if not r["gpu"]:
    lines.append("no GPU present (JAX sees no gpu device): the GPU rows are skipped")
  if r["gpu"] and not r["torch_cuda"]:
    lines.append("torch with CUDA is not installed: the TorchLoader rows are skipped")
  if r["gpu"]:
    lines += ["", "| path | H2D ms/batch | GB/s | × page-locked copy | data stall | steps/s |",
              "|---|---|---|---|---|---|"]
  for name, limit_key in (("to_device", "jax_limit"), ("TorchLoader", "torch_limit")):
    limit = r.get(limit_key)
    if not limit:
      continue
    locked = limit.get("page_locked_s")
    lines.append(f"| {name}: page-locked copy (the limit) | "
                 f"{locked * 1e3:.3f} | {mb / 1e3 / locked:.1f} | 1.00 | | |" if locked else
                 f"| {name}: page-locked copy | n/a (no cuda-python or torch) | | | | |")
    lines.append(f"| {name}: pageable copy | {limit['pageable_s'] * 1e3:.3f} | "
                 f"{mb / 1e3 / limit['pageable_s']:.1f} | "
                 f"{limit['pageable_s'] / locked if locked else float('nan'):.2f} | | |")
    got = r[name]
    ratio = got["transfer_s"] / locked if locked else float("nan")
    lines.append(f"| {name}: the service | {got['transfer_s'] * 1e3:.3f} | "
                 f"{got['h2d_gb_per_s']:.1f} | **{ratio:.2f}** (goal ≤ 1.25) | "
                 f"**{got['stall_fraction']:.1%}** (goal < 1%) | {got['steps_per_s']:.1f} |")
  lines.append("")
  lines.append("bit-exact against embedded mode: " + ", ".join(
      f"{k} {'yes' if v else 'NO'}" for k, v in r["exact"].items()))
  return "\n".join(lines)


def default_workers() -> int:
  """Half the cores, 2 to 8: the server shares the machine with the trainer."""
  return max(2, min(8, (os.cpu_count() or 2) // 2))


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--records", type=int, default=RECORDS,
                 help=f"records of the large workload (default {RECORDS:,}: 150 MB)")
  p.add_argument("--steps", type=int, default=300, help="steps per timed loop")
  p.add_argument("--step-ms", type=float, default=defaults.DEVICE_STEP_MS,
                 help="the device step, ms")
  p.add_argument("--workers", type=int, default=default_workers(),
                 help="server worker processes (default: half the cores, 2 to 8)")
  p.add_argument("--data", default=None, help="folder for the shards")
  p.add_argument("--json", default=None, help="also write the report here")


def run_from_args(a: argparse.Namespace) -> int:
  # JAX would take 75% of the GPU's memory at its first use, leaving torch little.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  data = pathlib.Path(a.data or os.path.join(tempfile.gettempdir(), "grain-elevator-bench"))
  report = run(data=data, records=a.records, workers=a.workers, steps=a.steps,
               step_ms=a.step_ms)
  print(table(report))
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
  return 0 if all(report["exact"].values()) else 1


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.device_feed",
                              description=__doc__.split("\n\n")[0])
  add_arguments(p)
  return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
