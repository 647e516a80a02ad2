"""Real trainers' own loaders around ours: MaxText's `MultiHostDataLoadIterator`
walks our iterator chain when it closes, and torchtitan's
`ParallelAwareDataloader` checkpoints per data-parallel rank.

The walks here are MaxText 0.2.5's (maxtext/input_pipeline/
multihost_dataloading.py: `_close_iterator`, `_terminate_iterator_workers`,
`MultiHostDataLoadIterator.close` and `__del__`), written out so that they
run without MaxText, which needs Python >= 3.12. Its process sweep
(`_cleanup_orphaned_multiprocessing_processes`, which kills any orphaned
multiprocessing process on the machine) is left out: it touches nothing of
ours. The recipes of docs/client.md (MaxText) and docs/pytorch.md
(torchtitan) run where those packages are installed, and are skipped with
the reason elsewhere.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Iterator

import grain
import numpy as np
import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.proto.errors import ElevatorError
from helpers import SCRIPTS, assert_trees_equal, oracle_batch

G = 96


def _walk_parents(it: Any, most: int = 64) -> list[Any]:
  """The chain from `it` down `_parent`, as code that walks Grain's
  iterators does: while `hasattr` says there is one."""
  chain = [it]
  while hasattr(chain[-1], "_parent") and len(chain) < most:
    chain.append(chain[-1]._parent)  # pylint: disable=protected-access
  return chain


def _maxtext_close_iterator(it: Any) -> None:
  """MaxText's `_close_iterator` (its try/except logs and goes on: here
  what it would have logged is raised)."""
  if it is None:
    return
  if hasattr(it, "close") and callable(it.close):
    it.close()
  elif callable(getattr(getattr(it, "_iterator", None), "close", None)):
    it._iterator.close()  # pylint: disable=protected-access


def _maxtext_terminate_workers(obj: Any) -> None:
  """MaxText's `_terminate_iterator_workers`: it looks for worker processes
  and pools on the object and its `_parent`, asked with `hasattr`, which lets
  anything but an AttributeError through (Grain's `_parent` asserts)."""
  if obj is None:
    return
  candidates = [obj]
  if hasattr(obj, "_iterator"):
    candidates.append(obj._iterator)  # pylint: disable=protected-access
  if hasattr(obj, "_parent"):
    candidates.append(obj._parent)  # pylint: disable=protected-access
  for c in candidates:
    workers = getattr(c, "_workers", None) or getattr(c, "workers", None)
    assert not workers, f"{c} has worker processes MaxText would terminate: {workers}"
    pool = getattr(c, "_pool", None)
    assert not callable(getattr(pool, "terminate", None)), f"{c}: MaxText would terminate {pool}"


class _MaxTextLoader:
  """MaxText's `MultiHostDataLoadIterator`, as far as its life goes:
  `iter(dataloader)` at start, and a `close()` that `__del__` calls."""

  def __init__(self, dataloader: Any):
    self.dataloader = dataloader
    self.local_iterator = iter(dataloader)

  def __next__(self) -> Any:
    return next(self.local_iterator)

  def close(self) -> None:
    if hasattr(self, "local_iterator"):
      _maxtext_close_iterator(self.local_iterator)
      _maxtext_terminate_workers(self.local_iterator)
    if hasattr(self, "dataloader"):
      _maxtext_close_iterator(self.dataloader)
      _maxtext_terminate_workers(self.dataloader)

  def __del__(self) -> None:
    self.close()


@pytest.fixture(params=["step", "stream"])
def dataset(request, serve, server, few_config) -> Iterator[tuple[RemoteDataset, str, Any]]:
  """(a host's RemoteDataset, its name, the server): "aug2" (a step
  dataset: StepIterator) or "few" (a stream: StreamIterator); closed after."""
  name, target, g = (("aug2", server, G) if request.param == "step" else
                     ("few", serve(few_config), 24))
  with RemoteDataset(target.target, name, g, shard_index=1, shard_count=2) as ds:
    yield ds, name, target


@pytest.mark.grain_contract
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "mapped"])
def test_maxtext_close_walks_our_chain_without_an_assertion(dataset, wrapped):
  """Before the fix Grain's `_parent` raised `AssertionError: ()` on our
  dataset and iterator, out of MaxText's `close()`. Now the chain ends at
  our source, with the iterator context Grain shares along it, and
  `close()` closes it."""
  ds, _, _ = dataset
  pipeline = ds.map(lambda batch: batch) if wrapped else ds
  loader = _MaxTextLoader(pipeline)
  next(loader)
  chain = _walk_parents(loader.local_iterator)
  assert len(chain) == (2 if wrapped else 1), chain
  source = chain[-1]
  assert isinstance(source, grain.DatasetIterator)
  assert source._parents == ()  # pylint: disable=protected-access
  assert source._ctx is loader.local_iterator._ctx  # pylint: disable=protected-access
  assert getattr(source, "_parent", None) is None
  with pytest.raises(AttributeError, match="a source of the pipeline, with no parent"):
    source._parent  # pylint: disable=pointless-statement,protected-access
  assert _walk_parents(ds) == [ds]
  loader.close()
  if wrapped and not hasattr(grain.DatasetIterator, "close"):
    # Grain 0.2.13's iterators have no close() to pass down the chain, and
    # MaxText's closes only the top: the dataset closes its own iterators.
    ds.close()
  with pytest.raises((ElevatorError, ValueError), match="closed"):  # ours, or Grain's
    next(loader)
  loader.close()  # twice, as __del__ does after close()


@pytest.mark.grain_contract
def test_dropping_a_maxtext_loader_prints_nothing(dataset, monkeypatch):
  """MaxText's `__del__` calls `close()`: before the fix every drop printed
  `Exception ignored in ... AssertionError: ()` (sys.unraisablehook)."""
  ds, _, _ = dataset
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  loader = _MaxTextLoader(ds)
  next(loader)
  it = loader.local_iterator
  del loader
  gc.collect()
  assert not [f"{u.exc_type.__name__}: {u.exc_value} in {u.object}" for u in unraisable]
  assert it._closed  # pylint: disable=protected-access


@pytest.mark.grain_contract
def test_resume_through_a_maxtext_loader_is_exact(dataset):
  """What MaxText's checkpointing saves is `local_iterator.get_state()`;
  restored into a new loader's iterator, the next step is the same rows."""
  ds, name, target = dataset
  loader = _MaxTextLoader(ds)
  for _ in range(3):
    next(loader)
  state = loader.local_iterator.get_state()
  want = next(loader)
  loader.close()
  fresh = RemoteDataset(target.target, name, ds.global_batch_size, shard_index=1, shard_count=2)
  again = _MaxTextLoader(fresh)
  again.local_iterator.set_state(state)
  assert_trees_equal(next(again), want, "the step after the restored state")
  again.close()


# --- MaxText itself (Python >= 3.12) ------------------------------------------

# A Python >= 3.12 with maxtext 0.2.5 and this package's client: named by
# ELEVATOR_MAXTEXT_PYTHON, else python3.12 or python3.13 on the PATH.
MAXTEXT_PYTHON = (os.environ.get("ELEVATOR_MAXTEXT_PYTHON") or shutil.which("python3.12")
                  or shutil.which("python3.13"))


def _maxtext_python() -> str:
  if MAXTEXT_PYTHON is None:
    pytest.skip("MaxText 0.2.5 requires Python >= 3.12; there is no python3.12 or "
                "python3.13 here (ELEVATOR_MAXTEXT_PYTHON names one); the walks above "
                "are MaxText's, written out")
  probe = subprocess.run([MAXTEXT_PYTHON, "-c", "import maxtext.input_pipeline."
                          "multihost_dataloading, grain_elevator.client"],
                         capture_output=True, text=True, timeout=300)
  if probe.returncode:
    pytest.skip(f"{MAXTEXT_PYTHON} cannot import maxtext 0.2.5 and grain_elevator's "
                f"client (pip install maxtext==0.2.5 grain-elevator): "
                f"{(probe.stderr.strip().splitlines() or [''])[0][:200]}")
  return MAXTEXT_PYTHON


def test_maxtext_recipe_of_the_client_docs(server, oracle, tmp_path):
  """docs/client.md's MaxText block, run by a Python that has MaxText:
  an 8-device mesh's global arrays are embedded mode's global batches, a
  restored `local_iterator` state continues exactly, close() raises nothing.
  (MaxText's close() also SIGKILLs any orphaned multiprocessing process on
  the machine: its own sweep, which the walks above leave out.)"""
  python = _maxtext_python()
  want = tmp_path / "want.npz"
  np.savez(want, **{f"{key}/{step}": leaf for step in range(4)
                    for key, leaf in oracle_batch(oracle, "aug2", step, G).items()})
  run = subprocess.run(
      [python, str(SCRIPTS / "maxtext_recipe.py"), "--target", server.target,
       "--dataset", "aug2", "--global-batch-size", str(G), "--want", str(want)],
      capture_output=True, text=True, timeout=600,
      env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert run.returncode == 0, run.stdout + run.stderr
  assert "global arrays exact; close() raised nothing" in run.stdout, run.stdout


# --- torchtitan -----------------------------------------------------------

# Where `make test` installs torchtitan and tyro, without torchtitan's own
# requirements (the Makefile's TITAN says why): on this test's path alone.
TITAN_DIR = pathlib.Path(sys.prefix) / "torchtitan"


def _titan() -> Any:
  pytest.importorskip("torch", reason="the torch extra is not installed")
  if TITAN_DIR.is_dir() and str(TITAN_DIR) not in sys.path:
    sys.path.append(str(TITAN_DIR))
  return pytest.importorskip(
      "torchtitan.components.dataloader", reason=(
          f"torchtitan is not installed: `make test` puts it in {TITAN_DIR} (the "
          "Makefile's TITAN), and `make test TORCH=` leaves it out"))


def test_torchtitan_refuses_a_state_of_another_world_size(server):
  """Why docs/pytorch.md's recipe exists: a plain ParallelAwareDataloader's
  state, saved on 2 data-parallel ranks, is refused on 1."""
  titan = _titan()
  from grain_elevator.client.torch import TorchLoader  # pylint: disable=import-outside-toplevel
  with RemoteDataset(server.target, "aug2", G, shard_index=0, shard_count=2) as ds:
    on2 = titan.ParallelAwareDataloader(TorchLoader(ds), dp_rank=0, dp_world_size=2,
                                        batch_size=None)
    next(iter(on2))
    state = on2.state_dict()
  with RemoteDataset(server.target, "aug2", G, shard_index=0, shard_count=1) as ds:
    on1 = titan.ParallelAwareDataloader(TorchLoader(ds), dp_rank=0, dp_world_size=1,
                                        batch_size=None)
    with pytest.raises(AssertionError, match="dp_degree is inconsistent"):
      on1.load_state_dict(state)


def test_torchtitan_recipe_resumes_on_another_world_size(server, config_path, tmp_path):
  """docs/pytorch.md's ElevatorDataloader on gloo ranks (DCP under
  torchtitan's `dataloader` key): 4 steps on 2 ranks, saved; 3 on 1,
  saved; 2 on 4; every pair embedded mode's rows for that rank and step."""
  _titan()
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  stages = [{"world": 2, "steps": 4, "save": two},
            {"world": 1, "steps": 3, "load": two, "save": one},
            {"world": 4, "steps": 2, "load": one}]
  run = subprocess.run(
      [sys.executable, str(SCRIPTS / "torchtitan_rank.py"), "--target", server.target,
       "--config", config_path, "--global-batch-size", str(G), "--out", str(tmp_path),
       *[arg for stage in stages for arg in ("--stage", json.dumps(stage))]],
      capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": os.pathsep.join(
          p for p in (os.environ.get("PYTHONPATH"), str(TITAN_DIR)) if p)})
  logs = {p.name: p.read_text() for p in sorted(tmp_path.glob("stage*-rank*.log"))}
  assert run.returncode == 0, f"{run.stdout}{run.stderr}\n{logs}"
  last = {name: text.strip().splitlines()[-1] for name, text in logs.items()}
  assert last == {
      **{f"stage0-rank{r}.log": f"rank {r}/2: steps 0..3 exact" for r in range(2)},
      "stage1-rank0.log": "rank 0/1: steps 4..6 exact",
      **{f"stage2-rank{r}.log": f"rank {r}/4: steps 7..8 exact" for r in range(4)}}, logs
