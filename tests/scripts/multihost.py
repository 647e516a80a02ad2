"""One JAX process of a multi-process job reading from a real server.

Checks that every addressable shard of step k's global array equals the
oracle's rows, then saves the iterator with Grain's orbax handler.
Run by tests/client/test_multihost.py; one process per `--process-id`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--coordinator", default="")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, default=96)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--checkpoint-dir", required=True)
  p.add_argument("--resume", action="store_true")
  args = p.parse_args()

  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.num_processes > 1:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import grain
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from grain_elevator.client import RemoteDataset, checkpoint, to_device
  from grain_elevator.client.embedded import EmbeddedBackend
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from helpers import oracle_batch

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  remote = RemoteDataset(args.target, args.dataset, args.global_batch_size)
  assert (remote.shard_index, remote.shard_count) == (jax.process_index(), jax.process_count())
  it = iter(to_device(remote, NamedSharding(mesh, P("data"))))
  manager = ocp.CheckpointManager(pathlib.Path(args.checkpoint_dir).resolve())
  start = 0
  if args.resume:
    step = manager.latest_step()
    checkpoint.restore(it, manager.directory / str(step) / "data")
    start = it.get_state()["step"]
  oracle = EmbeddedBackend(args.config)
  for k in range(start, start + args.steps):
    batch = next(it)
    expected = oracle_batch(oracle, args.dataset, k, args.global_batch_size)
    for key, array in batch.items():
      assert array.shape[0] == args.global_batch_size, array.shape
      want = np.asarray(jax.numpy.asarray(expected[key]))
      for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    print(f"process {jax.process_index()}/{jax.process_count()} "
          f"devices {jax.local_device_count()}: step {k} ok", flush=True)
  end = start + args.steps
  manager.save(end, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  manager.wait_until_finished()
  manager.close()
  remote.close()
  print(f"process {jax.process_index()}: saved step {end}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
