"""`elevator demo-torch`: a PyTorch model trained with torch.distributed from the service.

Writes labelled 8x8 images (pipelines/examples.py: a template per class plus
noise, ids 0..N-1) and serves one shuffled epoch of them with 2 workers. Two
CPU processes (gloo, as torchrun would start them) train a small network
with DistributedDataParallel, each reading its half of every global batch
through a `TorchLoader` that takes its rank from torch.distributed. Midway
they save the model, the optimizer and the loader with
torch.distributed.checkpoint and exit; one fresh process loads that
checkpoint and trains to the end of the epoch. Checks: every record was
trained on exactly once over the three processes, and the loss fell.
"""

from __future__ import annotations

import os
import pathlib
import socket
import tempfile
import textwrap
import time
import warnings

import numpy as np

RECORDS = 4096
GLOBAL_BATCH = 64
SIDE = 8
CLASSES = 10


def write_dataset(root: pathlib.Path) -> str:
  """The shards and the config; returns the config's path."""
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  examples.write_image_shards(str(root / "shards"), num_records=RECORDS, num_shards=4,
                              height=SIDE, width=SIDE, channels=1, num_classes=CLASSES)
  config = root / "elevator.toml"
  config.write_text(textwrap.dedent(f"""\
      [datasets.digits]
      paths = ["shards/*.array_record"]
      pipeline = "grain_elevator.pipelines.examples:decode_images"
      seed = 5
      [datasets.digits.options]
      height = {SIDE}
      width = {SIDE}
      channels = 1
      """))
  print(f"[data]   wrote {RECORDS:,} labelled {SIDE}x{SIDE} images ({CLASSES} classes) "
        f"in {root}")
  return str(config)


def _rank(rank: int, world: int, target: str, checkpoint: str, out: str, steps: int | None,
          load: bool) -> None:
  """One process of the job: trains `steps` steps (None: to the end of the
  epoch), from the checkpoint if `load`, and saves one if `steps` is given."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
  from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  from grain_elevator.client.torch import TorchLoader  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(1)
  # DCP says so when it loads in one process, which is this demo's point.
  warnings.filterwarnings("ignore", message="torch.distributed is disabled")
  if world > 1:
    dist.init_process_group("gloo", rank=rank, world_size=world)
  torch.manual_seed(0)  # the same initial weights on every rank
  model: torch.nn.Module = torch.nn.Sequential(
      torch.nn.Flatten(), torch.nn.Linear(SIDE * SIDE, 64), torch.nn.ReLU(),
      torch.nn.Linear(64, CLASSES))
  if world > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)
  opt = torch.optim.Adam(model.parameters(), lr=3e-3)
  loader = TorchLoader(RemoteDataset(target, "digits", GLOBAL_BATCH))  # rank from dist
  if load:
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": opt_state, "data": loader}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
  ids, losses = [], []
  for batch in loader:
    x = batch["image"].float() / 255.0
    loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    ids.append(batch["id"].numpy().copy())
    losses.append(loss.item())
    if world > 1:  # the job's loss: the mean over ranks
      mean = torch.tensor(losses[-1])
      dist.all_reduce(mean)
      losses[-1] = float(mean) / world
    if rank == 0 and len(losses) % 8 == 0:
      print(f"[train]  {world} process{'es' if world > 1 else ''}: step "
            f"{_step(loader):3d}  loss {np.mean(losses[-8:]):.3f}", flush=True)
    if steps is not None and len(losses) == steps:
      break
  if steps is not None:
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state, "data": loader},
             checkpoint_id=checkpoint)
  np.savez(os.path.join(out, f"{'resumed' if load else 'first'}-{rank}.npz"),
           ids=np.concatenate(ids), losses=np.asarray(losses))
  loader.dataset.close()
  if world > 1:
    dist.destroy_process_group()


def _step(loader) -> int:
  import json  # pylint: disable=g-import-not-at-top
  from grain_elevator.client.torch import STATE_KEY  # pylint: disable=g-import-not-at-top
  return json.loads(loader.state_dict()[STATE_KEY])["step"]


def _spawned(index: int, world: int, *args) -> None:
  _rank(index, world, *args)


def _run_job(world: int, *args) -> None:
  import torch.multiprocessing as mp  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  mp.spawn(_spawned, args=(world, *args), nprocs=world, join=True)


def run(workers: int = 2, data_dir: str | None = None) -> int:
  """Runs the demo; 0 when every record was seen once and the loss fell."""
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top

  tmp = None
  if data_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="elevator-demo-torch-")
    data_dir = tmp.name
  root = pathlib.Path(data_dir)
  steps = RECORDS // GLOBAL_BATCH
  try:
    config = write_dataset(root)
    out, checkpoint = root / "out", str(root / "checkpoint")
    out.mkdir(exist_ok=True)
    with LocalServer(config, workers=workers) as server:
      print(f"[server] serving 'digits' on {server.target} with {workers} worker "
            f"processes: one epoch, {steps} steps of {GLOBAL_BATCH}")
      t0 = time.perf_counter()
      _run_job(2, server.target, checkpoint, str(out), steps // 2, False)
      print(f"[stop]   2 processes saved model, optimizer and data cursor at step "
            f"{steps // 2} with torch.distributed.checkpoint in {checkpoint}")
      _run_job(1, server.target, checkpoint, str(out), None, True)
      print(f"[resume] 1 process loaded it and trained to the end of the epoch "
            f"({time.perf_counter() - t0:.1f} s in all)")
    parts = [np.load(out / name) for name in ("first-0.npz", "first-1.npz", "resumed-0.npz")]
    ids = np.concatenate([p["ids"] for p in parts])
    losses = np.concatenate([parts[0]["losses"], parts[2]["losses"]])
    once = np.array_equal(np.sort(ids), np.arange(RECORDS))
    first, last = losses[:8].mean(), losses[-8:].mean()
    print(f"[check]  {ids.size:,} records trained on: "
          f"{'every record exactly once' if once else 'NOT every record exactly once'}; "
          f"loss {first:.2f} -> {last:.2f}")
    return 0 if once and last < first else 1
  finally:
    if tmp is not None:
      tmp.cleanup()
