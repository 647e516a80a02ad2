"""One torch.distributed rank (gloo) reading from a real server.

Reads `--steps` batches through a `TorchLoader` whose `RemoteDataset` takes
its shard from torch.distributed, checks every batch against embedded mode
(the rank's rows, or with --dtensor the whole global batch gathered from the
DTensor), and saves or loads the loader with torch.distributed.checkpoint.
Run by tests/client/test_torch.py, one process per rank (as torchrun would).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import numpy as np


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, default=96)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--load", default="", help="a DCP checkpoint to continue from")
  p.add_argument("--save", default="", help="where to save a DCP checkpoint at the end")
  p.add_argument("--dtensor", action="store_true")
  args = p.parse_args()

  import torch
  import torch.distributed as dist
  import torch.distributed.checkpoint as dcp

  world = int(os.environ.get("WORLD_SIZE", "1"))
  if world > 1:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the env
  from grain_elevator.client import RemoteDataset
  from grain_elevator.client.embedded import EmbeddedBackend
  from grain_elevator.client.torch import TorchLoader, data_parallel_shard
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from helpers import oracle_batch

  g = args.global_batch_size
  remote = RemoteDataset(args.target, args.dataset, g)  # shard from torch.distributed
  h, n = data_parallel_shard()
  assert (remote.shard_index, remote.shard_count) == (h, n), (remote, h, n)
  mesh = None
  if args.dtensor:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
  loader = TorchLoader(remote, mesh=mesh)
  if args.load:
    dcp.load({"data": loader}, checkpoint_id=args.load)
  it = iter(loader)
  oracle = EmbeddedBackend(args.config)
  first = None
  for _ in range(args.steps):
    batch = next(it)
    step = _step_of(loader) - 1
    first = step if first is None else first
    if args.dtensor:
      want = oracle_batch(oracle, args.dataset, step, g)
      for key, t in batch.items():
        full = t.full_tensor()
        assert full.shape[0] == g and t.to_local().shape[0] == g // world, (key, t.shape)
        np.testing.assert_array_equal(full.numpy(), want[key], err_msg=f"{key} step {step}")
    else:
      want = oracle_batch(oracle, args.dataset, step, g, h, n)
      for key, t in batch.items():
        assert isinstance(t, torch.Tensor), (key, type(t))
        np.testing.assert_array_equal(t.numpy(), want[key], err_msg=f"{key} step {step}")
  if args.save:
    dcp.save({"data": loader}, checkpoint_id=args.save)
  print(f"rank {h}/{n}: steps {first}..{step} exact", flush=True)
  remote.close()
  if world > 1:
    dist.destroy_process_group()
  return 0


def _step_of(loader) -> int:
  import json
  from grain_elevator.client.torch import STATE_KEY
  return json.loads(loader.state_dict()[STATE_KEY])["step"]


if __name__ == "__main__":
  sys.exit(main())
