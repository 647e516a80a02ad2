"""torchtitan's data loader over a TorchLoader, on gloo ranks, world after world.

docs/pytorch.md's torchtitan recipe, run as it stands there (its code block
defining `ElevatorDataloader`, executed): each rank builds the loader with
its data-parallel rank and size, loads it from a checkpoint written on
another world size (torch.distributed.checkpoint, under torchtitan's
`dataloader` key, as its CheckpointManager keeps it), reads `steps`
`(input_dict, labels)` pairs, checks each against embedded mode's rows, and
saves. The launcher (stages, forked ranks, their logs) is
tests/scripts/torch_rank.py's; this file gives the rank its work. Run by
tests/client/test_trainer_loaders.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
# Imported before any rank forks (torch_rank.py imports the rest).
from torchtitan.components import dataloader as _titan  # pylint: disable=unused-import

import torch_rank  # puts tests/ on the path, for helpers
from grain_elevator.client import RemoteDataset
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.client.torch import TorchLoader
from helpers import oracle_batch  # pylint: disable=g-import-not-at-top

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"


def recipe() -> dict[str, Any]:
  """The names docs/pytorch.md's block defining ElevatorDataloader defines."""
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  (block,) = [b for b in blocks if "class ElevatorDataloader" in b]
  names: dict[str, Any] = {"__name__": "pytorch_md_recipe"}
  exec(compile(block, f"{DOC}:ElevatorDataloader", "exec"), names)  # pylint: disable=exec-used
  return names


def _read(a: argparse.Namespace, stage: dict[str, Any]) -> None:
  world = int(os.environ["WORLD_SIZE"])
  if world > 1:
    dist.init_process_group("gloo")
  rank = dist.get_rank() if world > 1 else 0
  names = recipe()
  g = a.global_batch_size
  ds = RemoteDataset(a.target, a.dataset, g, shard_index=rank, shard_count=world)
  loader = TorchLoader(ds)
  dataloader = names["ElevatorDataloader"](loader, rank, world,
                                           collate_fn=names["input_and_labels"])
  states = {"dataloader": dataloader}  # torchtitan's CheckpointManager key
  if stage.get("load"):
    dcp.load(states, checkpoint_id=stage["load"])
  oracle = EmbeddedBackend(a.config)
  it = iter(dataloader)
  first = step = None
  for _ in range(stage["steps"]):
    input_dict, labels = next(it)
    step = torch_rank._step_of(loader) - 1  # pylint: disable=protected-access
    first = step if first is None else first
    want = oracle_batch(oracle, a.dataset, step, g, rank, world)
    np.testing.assert_array_equal(input_dict["input"].numpy(), want["image"],
                                  err_msg=f"input step {step}")
    np.testing.assert_array_equal(labels.numpy(), want["label"], err_msg=f"labels step {step}")
  if stage.get("save"):
    dcp.save(states, checkpoint_id=stage["save"])
  print(f"rank {rank}/{world}: steps {first}..{step} exact", flush=True)
  ds.close()
  if world > 1:
    dist.destroy_process_group()


if __name__ == "__main__":
  # The rank's work is this file's; the launcher is torch_rank.main's.
  torch_rank._read = _read  # pylint: disable=protected-access
  sys.exit(torch_rank.main())
