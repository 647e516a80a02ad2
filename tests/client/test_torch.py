"""PyTorch trainers (client/torch.py): tensors bit-identical to embedded mode,
ranks from torch.distributed (gloo processes, as torchrun starts them),
DTensor on a DeviceMesh, checkpoints through torch.distributed.checkpoint on
2 ranks resumed on 1 and on 4, torchdata's StatefulDataLoader around the
loader, and tensors that never change under the trainer while the receive
buffers are reused."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from grain_elevator.client import RemoteDataset, StreamMismatchError, TransportOptions
from grain_elevator.client.torch import STATE_KEY, TorchLoader, data_parallel_shard, to_tensors
from grain_elevator.proto.errors import InvalidRequestError
from helpers import ROOT, oracle_batch

G = 96
SCRIPT = ROOT / "tests" / "scripts" / "torch_rank.py"


def _worlds(server, config_path: str, out: pathlib.Path,
            stages: list[dict]) -> list[list[str]]:
  """Runs each stage's world of gloo ranks of tests/scripts/torch_rank.py
  (one launcher, its ranks forked after its imports), one after another;
  each rank's output, by stage."""
  run = subprocess.run(
      [sys.executable, str(SCRIPT), "--target", server.target, "--config", config_path,
       "--global-batch-size", str(G), "--out", str(out),
       *[arg for stage in stages for arg in ("--stage", json.dumps(stage))]],
      capture_output=True, text=True, timeout=600)
  logs = {p.name: p.read_text() for p in sorted(out.glob("stage*-rank*.log"))}
  assert run.returncode == 0, f"{run.stdout}{run.stderr}\n{logs}"
  return [[logs[f"stage{i}-rank{r}.log"] for r in range(stage["world"])]
          for i, stage in enumerate(stages)]


def _tensors_equal(batch, want) -> None:
  assert sorted(batch) == sorted(want)
  for key, t in batch.items():
    assert isinstance(t, torch.Tensor), (key, type(t))
    np.testing.assert_array_equal(t.numpy(), want[key], err_msg=key)


@pytest.mark.parametrize("kind", ["bulk", "grpc"])
def test_tensors_are_embedded_modes_rows(server, oracle, kind):
  ds = RemoteDataset(server.target, "aug2", G, shard_index=1, shard_count=2,
                     transport=TransportOptions(kind=kind))
  with ds:
    it = iter(TorchLoader(ds))
    for step in range(6):
      _tensors_equal(next(it), oracle_batch(oracle, "aug2", step, G, 1, 2))


def test_a_tensor_never_changes_under_the_trainer_while_buffers_are_reused(big_server,
                                                                          big_oracle):
  """The trainer keeps every third batch's tensors and drops the rest: the
  dropped ones' receive buffers come back for later steps (the same
  addresses), the kept tensors stay exactly embedded mode's rows. 32 rows
  of 3 KiB make each frame large enough to be pooled (conftest's big_rows)."""
  g = 32
  kept, addresses = {}, []
  with RemoteDataset(big_server.target, "forever", g, prefetch=8,
                     transport=TransportOptions(kind="bulk")) as ds:
    it = iter(TorchLoader(ds))
    for k in range(45):
      batch = next(it)
      assert batch["image"].numel() * batch["image"].element_size() >= 96 << 10
      addresses.append(batch["image"].data_ptr())
      if k % 3 == 0:
        kept[k] = batch
  assert len(set(addresses)) < len(addresses), "no receive buffer was ever reused"
  for k, batch in kept.items():
    _tensors_equal(batch, oracle_batch(big_oracle, "forever", k, g))


def test_state_dict_round_trips_through_json_and_refuses_another_stream(server, oracle):
  with RemoteDataset(server.target, "aug2", G) as ds:
    loader = TorchLoader(ds)
    it = iter(loader)
    for _ in range(3):
      next(it)
    saved = json.loads(json.dumps(loader.state_dict()))
  assert json.loads(saved[STATE_KEY])["step"] == 3
  # What DCP and torchtitan's checkpointer call state_dict/load_state_dict on.
  from torch.distributed.checkpoint.stateful import Stateful  # pylint: disable=g-import-not-at-top
  assert isinstance(loader, Stateful)
  with RemoteDataset(server.target, "aug2", G, shard_index=0, shard_count=2) as ds:
    fresh = TorchLoader(ds)
    fresh.load_state_dict(saved)
    _tensors_equal(next(iter(fresh)), oracle_batch(oracle, "aug2", 3, G, 0, 2))
  with RemoteDataset(server.target, "seed3", G) as other:
    with pytest.raises(StreamMismatchError, match="another stream"):
      TorchLoader(other).load_state_dict(saved)
    with pytest.raises(InvalidRequestError, match="not a TorchLoader state"):
      TorchLoader(other).load_state_dict({"step": 3})


def test_stream_datasets_arrive_as_tensors_too(serve, few_config):
  with RemoteDataset.embedded(few_config, "few", 24, prefetch=0) as oracle:
    it = iter(oracle)
    want = [next(it) for _ in range(5)]
  server = serve(few_config)
  with RemoteDataset(server.target, "few", 24) as ds:
    loader = TorchLoader(ds)
    it = iter(loader)
    for k in range(3):
      _tensors_equal(next(it), want[k])
    saved = json.loads(json.dumps(loader.state_dict()))
  with RemoteDataset(server.target, "few", 24, shard_index=1, shard_count=2) as ds:
    fresh = TorchLoader(ds)
    fresh.load_state_dict(saved)
    it = iter(fresh)
    for k in (3, 4):
      _tensors_equal(next(it), {key: v[12:] for key, v in want[k].items()})


def test_torchdatas_stateful_dataloader_saves_and_resumes_the_loader(server, oracle):
  stateful = pytest.importorskip("torchdata.stateful_dataloader")
  with RemoteDataset(server.target, "aug2", G) as ds:
    dl = stateful.StatefulDataLoader(TorchLoader(ds), batch_size=None, num_workers=0)
    it = iter(dl)
    for _ in range(4):
      next(it)
    saved = json.loads(json.dumps(dl.state_dict()))
  with RemoteDataset(server.target, "aug2", G) as ds:
    dl = stateful.StatefulDataLoader(TorchLoader(ds), batch_size=None, num_workers=0)
    dl.load_state_dict(saved)
    it = iter(dl)
    for step in (4, 5):
      _tensors_equal(next(it), oracle_batch(oracle, "aug2", step, G))


# In a process of its own: DataLoader workers are forks of the process that
# iterates, and a fork of this one (gRPC's and JAX's threads running) can
# hang in the child or leave the parent's gRPC unusable for the tests after.
_FORKING_LOADER = """
import sys, torch
from grain_elevator.client import RemoteDataset
from grain_elevator.client.torch import TorchLoader
with RemoteDataset(sys.argv[1], "aug2", 96) as ds:
  next(iter(torch.utils.data.DataLoader(TorchLoader(ds), batch_size=None, num_workers=2)))
"""


def test_dataloader_workers_are_refused_with_the_fix(server):
  """Each worker would read the same rows: the first batch is an error that
  says to use num_workers=0."""
  run = subprocess.run([sys.executable, "-c", _FORKING_LOADER, server.target],
                       capture_output=True, text=True, timeout=120)
  assert run.returncode != 0
  assert "TorchLoader runs in DataLoader worker" in run.stderr, run.stderr
  assert "Use num_workers=0" in run.stderr, run.stderr


def test_leaves_become_tensors_over_the_same_memory():
  """bfloat16 (ml_dtypes) reinterpreted, no copy; bytes stay numpy."""
  ml_dtypes = pytest.importorskip("ml_dtypes")
  images = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
  ids = np.arange(2, dtype=np.uint16)
  names = np.array([b"ab", b"cd"])
  out = to_tensors({"images": images, "ids": ids, "names": names})
  assert out["images"].dtype == torch.bfloat16
  assert out["images"].float().tolist() == images.astype(np.float32).tolist()
  assert out["images"].data_ptr() == images.ctypes.data
  assert out["ids"].dtype == torch.uint16 and out["ids"].data_ptr() == ids.ctypes.data
  assert out["names"] is names


def test_no_process_group_means_one_host():
  assert data_parallel_shard() == (0, 1)


def test_dcp_saved_on_two_ranks_resumes_on_one_then_four(server, config_path, tmp_path):
  """Steps 0-3 on 2 gloo ranks as DTensors on a DeviceMesh (each checks the
  gathered global batch), saved with dcp.save; 4-6 on 1 rank from dcp.load;
  7-8 on 4 ranks. Every rank takes its shard from torch.distributed and
  checks its rows of the step its restored cursor says, against embedded
  mode."""
  two, one = str(tmp_path / "on2"), str(tmp_path / "on1")
  on2, on1, on4 = _worlds(server, config_path, tmp_path, [
      {"world": 2, "steps": 4, "dtensor": True, "save": two},
      {"world": 1, "steps": 3, "load": two, "save": one},
      {"world": 4, "steps": 2, "load": one}])
  assert all("steps 0..3 exact" in o for o in on2), on2
  (out,) = on1
  assert "rank 0/1: steps 4..6 exact" in out, out
  assert [o.strip().splitlines()[-1] for o in on4] == [
      f"rank {h}/4: steps 7..8 exact" for h in range(4)], on4
