"""torch.distributed ranks (gloo) reading from a real server, world after world.

Each rank reads `steps` batches through a `TorchLoader` whose `RemoteDataset`
takes its shard from torch.distributed, checks every batch against embedded
mode (the rank's rows, or with "dtensor" the whole global batch gathered
from the DTensor), and saves or loads the loader with
torch.distributed.checkpoint.

Each `--stage` (JSON: world, steps, and optionally load, save, dtensor) is a
world of ranks run after the one before: a process per rank, with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment, as torchrun
starts them. The ranks are forks of this process (torch.multiprocessing,
start method "fork"), which imported torch, Grain and the client once before
any thread or connection: a fresh interpreter per rank paid those imports
(~5 CPU-seconds) seven times. Rank r of stage i writes its output to
OUT/stage<i>-rank<r>.log. Run by tests/client/test_torch.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import sys
from typing import Any

import numpy as np
# Imported before any rank forks, so that no rank imports them again.
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing
from torch.distributed.device_mesh import init_device_mesh

from grain_elevator.client import RemoteDataset
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.client.torch import STATE_KEY, TorchLoader, data_parallel_shard
from grain_elevator.server.process import lifeline
# What EmbeddedBackend imports when it opens a config.
from grain_elevator.server.data import config as _config  # pylint: disable=unused-import
from grain_elevator.server.data import registry as _registry  # pylint: disable=unused-import
from grain_elevator.server.serving import request_path as _request_path  # pylint: disable=unused-import

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from helpers import oracle_batch  # pylint: disable=g-import-not-at-top


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, log: str, a: argparse.Namespace,
          stage: dict[str, Any]) -> None:
  """One rank, in a fork of the launcher (killed if it dies): its output to
  `log`, its place in the world from the environment, as torchrun gives it."""
  lifeline.tie(os.getppid(), signal.SIGKILL)
  fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
  _read(a, stage)
  sys.stdout.flush()


def _read(a: argparse.Namespace, stage: dict[str, Any]) -> None:
  world = int(os.environ["WORLD_SIZE"])
  if world > 1:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the env
  g = a.global_batch_size
  remote = RemoteDataset(a.target, a.dataset, g)  # shard from torch.distributed
  h, n = data_parallel_shard()
  assert (remote.shard_index, remote.shard_count) == (h, n), (remote, h, n)
  mesh = None
  if stage.get("dtensor"):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
  loader = TorchLoader(remote, mesh=mesh)
  if stage.get("load"):
    dcp.load({"data": loader}, checkpoint_id=stage["load"])
  it = iter(loader)
  oracle = EmbeddedBackend(a.config)
  first = None
  for _ in range(stage["steps"]):
    batch = next(it)
    step = _step_of(loader) - 1
    first = step if first is None else first
    if stage.get("dtensor"):
      want = oracle_batch(oracle, a.dataset, step, g)
      for key, t in batch.items():
        full = t.full_tensor()
        assert full.shape[0] == g and t.to_local().shape[0] == g // world, (key, t.shape)
        np.testing.assert_array_equal(full.numpy(), want[key], err_msg=f"{key} step {step}")
    else:
      want = oracle_batch(oracle, a.dataset, step, g, h, n)
      for key, t in batch.items():
        assert isinstance(t, torch.Tensor), (key, type(t))
        np.testing.assert_array_equal(t.numpy(), want[key], err_msg=f"{key} step {step}")
  if stage.get("save"):
    dcp.save({"data": loader}, checkpoint_id=stage["save"])
  print(f"rank {h}/{n}: steps {first}..{step} exact", flush=True)
  remote.close()
  if world > 1:
    dist.destroy_process_group()


def _step_of(loader) -> int:
  return json.loads(loader.state_dict()[STATE_KEY])["step"]


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, default=96)
  p.add_argument("--out", required=True, help="folder of the ranks' logs")
  p.add_argument("--stage", action="append", type=json.loads, required=True,
                 help='a world, e.g. {"world": 2, "steps": 4, "dtensor": true, "save": DIR}')
  a = p.parse_args()
  for i, stage in enumerate(a.stage):
    world, port = stage["world"], _free_port()
    logs = [os.path.join(a.out, f"stage{i}-rank{r}.log") for r in range(world)]
    try:
      torch.multiprocessing.start_processes(
          lambda r: _rank(r, world, port, logs[r], a, stage), nprocs=world,
          start_method="fork")
    except Exception as e:  # pylint: disable=broad-except
      print(f"stage {i} ({world} ranks) failed: {e}", flush=True)
      return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
