"""`elevator bench-feed`: does the accelerator wait for data?

A training loop with a jitted step of adjustable duration consumes
device-resident batches from (a) Grain's own recipe on a local pipeline
(`ThreadPrefetch -> device_put -> ThreadPrefetch`, what
`grain.experimental.device_put` does) and (b) the service through
`to_device`. Reports the data-stall fraction (time the loop waits in `next`
/ wall time) and host->device GB/s (bytes / time spent in the transfer).

The step is "device time": a small jitted reduction over the batch, then the
host sleeps until the step's duration has passed, as it would while an
accelerator computes. On a CPU-only machine a compute-bound step would
instead take the very cores that prepare the data.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class TransferClock:
  """Accumulates batches, bytes and seconds spent in device transfers (thread-safe)."""
  count: int = 0
  nbytes: int = 0
  seconds: float = 0.0
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  def timed_put(self, put: Callable[[Any], Any]) -> Callable[[Any], Any]:
    import jax  # pylint: disable=g-import-not-at-top

    def wrapped(batch: Any) -> Any:
      t = time.perf_counter()
      out = jax.block_until_ready(put(batch))
      dt = time.perf_counter() - t
      size = sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
      with self.lock:
        self.count += 1
        self.nbytes += size
        self.seconds += dt
      return out
    return wrapped


def training_loop(it: Any, steps: int, step_s: float) -> dict[str, float]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  """Takes `steps` batches with a `step_s` device step each (a jitted
  reduction, then the host sleeps out the step): the data-stall fraction."""
  touch = jax.jit(lambda b: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(b)))
  for _ in range(5):  # warm up: compile, fill buffers
    jax.block_until_ready(touch(next(it)))
  wait = 0.0
  t0 = time.perf_counter()
  for _ in range(steps):
    t = time.perf_counter()
    batch = next(it)
    wait += time.perf_counter() - t
    start = time.perf_counter()
    jax.block_until_ready(touch(batch))
    remaining = step_s - (time.perf_counter() - start)
    if remaining > 0:
      time.sleep(remaining)
  wall = time.perf_counter() - t0
  return {"stall_fraction": wait / wall, "steps_per_s": steps / wall}


def _pinned_copy_gbps(nbytes: int) -> float:
  """The platform's plain host->device copy rate for one batch-sized buffer."""
  import jax  # pylint: disable=g-import-not-at-top
  host = np.ones(nbytes, dtype=np.uint8)
  dev = jax.devices()[0]
  jax.block_until_ready(jax.device_put(host, dev))
  times = []
  for _ in range(10):
    t = time.perf_counter()
    jax.block_until_ready(jax.device_put(host, dev))
    times.append(time.perf_counter() - t)
  return nbytes / statistics.median(times) / 1e9


def run(*, server_target: str, dataset: str, files: list[str],
        options: dict[str, Any], global_batch_size: int, steps: int,
        step_ms: float) -> dict[str, dict[str, float]]:
  import grain  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import device  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset, TransportOptions  # pylint: disable=g-import-not-at-top
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  results = {}

  # (a) Grain's recipe on a local pipeline, at its best single-process setting.
  clock = TransferClock()
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
  ds = examples.decode_images(ds.seed(1).shuffle().repeat(None), **options)
  ds = ds.batch(global_batch_size).to_iter_dataset(grain.ReadOptions(num_threads=0))
  it = iter(device.buffered_put(
      ds, clock.timed_put(lambda b: jax.device_put(b, sharding)), 4, 2))
  r = training_loop(it, steps, step_ms / 1e3)
  results["local Grain + device_put recipe"] = {
      **r, "h2d_gb_per_s": clock.nbytes / clock.seconds / 1e9}
  it.close()

  # (b) The service through to_device's stages, its put timed.
  clock = TransferClock()
  remote = RemoteDataset(server_target, dataset, global_batch_size, prefetch=16,
                         transport=TransportOptions(steps_per_request=4))
  it = iter(device.buffered_put(
      remote, clock.timed_put(device.PutOnMesh(sharding, None)), 4, 2))
  r = training_loop(it, steps, step_ms / 1e3)
  results["grain-elevator service + to_device"] = {
      **r, "h2d_gb_per_s": clock.nbytes / clock.seconds / 1e9}
  it.close()
  remote.close()
  batch_bytes = global_batch_size * (16 + int(np.prod([options["height"], options["width"],
                                                        options["channels"]])) * 4)
  results["platform copy (one buffer, device_put)"] = {
      "h2d_gb_per_s": _pinned_copy_gbps(batch_bytes)}
  return results
