"""A shard replaced while the server runs never changes what a step holds
under one fingerprint: each answer is the bytes the server started with, or
FAILED_PRECONDITION naming the shard; a server restarted on the new files
has another fingerprint and refuses the old one's cursors.

Each test writes its own shards (it replaces them), 200 records a shard and
no shuffle, so steps 0-9 read shard 0 only, 10-19 shard 1, 20-29 shard 2.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import shutil
import signal
import textwrap
import time
from typing import Any, Callable

import grpc
import pytest

from grain_elevator.client import RemoteDataset, ShardChangedError, StreamMismatchError
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.server import dataset as dataset_lib
from grain_elevator.server import shard_identity
from grain_elevator.server import shard_reader
from grain_elevator.server.config import load_config
from grain_elevator.tools import examples
from grain_elevator.tools.launcher import LocalServer
from helpers import assert_trees_equal, worker_pids

G, STEPS_PER_SHARD, NUM_SHARDS = 20, 10, 3
IMAGE = {"height": 4, "width": 4, "channels": 3}
CONFIG = textwrap.dedent("""\
    [datasets.plain]
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.tools.examples:decode_images"
    shuffle = false
    [datasets.plain.options]
    height = 4
    width = 4
    channels = 3
    """)


class Data:
  """A private dataset, its shards, and same-count replacements with other bytes."""

  def __init__(self, root: pathlib.Path):
    n = G * STEPS_PER_SHARD * NUM_SHARDS
    self.shards = examples.write_image_shards(str(root / "shards"), num_records=n,
                                              num_shards=NUM_SHARDS, **IMAGE)
    self.others = examples.write_image_shards(str(root / "other"), num_records=n,
                                              num_shards=NUM_SHARDS, seed=1, **IMAGE)
    self.config = str(root / "elevator.toml")
    pathlib.Path(self.config).write_text(CONFIG)
    time.sleep(0.01)  # a rewrite's mtime must differ from the original's

  def stream(self) -> list[Any]:
    """Every step as embedded mode computes it now: the oracle."""
    with RemoteDataset.embedded(self.config, "plain", G) as ds:
      return list(ds)

  def replace(self, shard: int, how: str) -> None:
    """Shard `shard` now holds the replacement's bytes: a new file renamed over
    it (the atomic way), or rewritten into the same file."""
    path, other = self.shards[shard], self.others[shard]
    if how == "rename":
      shutil.copyfile(other, path + ".new")  # not matched by the config's glob
      os.rename(path + ".new", path)
    else:
      with open(path, "r+b") as f:
        f.write(pathlib.Path(other).read_bytes())
        f.truncate()


@pytest.fixture
def data(tmp_path: pathlib.Path) -> Data:
  return Data(tmp_path)


def _structure(config: str) -> Any:
  (info,) = EmbeddedBackend(config).describe("plain")
  return info.element_spec.structure


def _ask(target: str, step: int, structure: Any) -> tuple[int, Any]:
  """On a new connection (so any worker): (the worker's index, the step's
  batch or the grpc.RpcError it got)."""
  options = [("grpc.use_local_subchannel_pool", 1)]
  with grpc.insecure_channel(target, options=options) as channel:
    stub = pb_grpc.ElevatorStub(channel)
    worker = stub.Describe(pb.DescribeRequest(dataset="plain"), timeout=30).server.worker_index
    request = pb.BatchRequest(dataset="plain", global_batch_size=G, shard_index=0,
                              shard_count=1, start_step=step, num_steps=1)
    try:
      (batch,) = stub.GetBatches(request, timeout=30)
    except grpc.RpcError as e:
      return worker, e
    return worker, wire.decode_batch(batch.SerializeToString(), structure)[1]


def _refused(answer: Any, shard: str) -> bool:
  return (isinstance(answer, grpc.RpcError)
          and answer.code() == grpc.StatusCode.FAILED_PRECONDITION
          and f"shard {shard} changed since the server started" in answer.details())


def _ask_every_worker(server: LocalServer, steps: range, structure: Any,
                      judge: Callable[[int, int, Any], None], workers: int = 2) -> None:
  """Asks for each of `steps` on new connections, and on until each of the
  `workers` has answered (a restarted one may take seconds to listen),
  handing each answer to `judge(worker, step, answer)`."""
  seen: set[int] = set()
  deadline = time.monotonic() + 60
  for k in itertools.count():
    step = steps[k % len(steps)]
    worker, answer = _ask(server.target, step, structure)
    judge(worker, step, answer)
    seen.add(worker)
    if len(seen) == workers and k >= len(steps):
      return
    if time.monotonic() > deadline:
      pytest.fail(f"in 60 s only workers {sorted(seen)} answered:\n{server.stderr()}")
    if k >= 2 * len(steps):
      time.sleep(0.05)


def _shard_steps(shard: int) -> range:
  return range(shard * STEPS_PER_SHARD, (shard + 1) * STEPS_PER_SHARD)


def test_workers_refuse_shards_replaced_before_they_open_them(data):
  expected = data.stream()
  structure = _structure(data.config)
  with LocalServer(data.config, workers=2) as server:
    with RemoteDataset(server.target, "plain", G, prefetch=0) as ds:
      it = iter(ds)
      for step in _shard_steps(0):  # shards 1 and 2 stay unopened in both workers
        assert_trees_equal(next(it), expected[step], f"step {step}")
    data.replace(1, "rename")
    data.replace(2, "in place")

    def judge(worker: int, step: int, answer: Any) -> None:
      shard = data.shards[step // STEPS_PER_SHARD]
      if step < STEPS_PER_SHARD:
        assert_trees_equal(answer, expected[step], f"worker {worker} step {step}")
      else:
        assert _refused(answer, shard), f"worker {worker} step {step}: {answer}"

    _ask_every_worker(server, range(0, 30, 3), structure, judge)
    # The client raises the refusal; the unchanged shard still reads.
    with RemoteDataset(server.target, "plain", G) as ds:
      it = iter(ds)
      it.set_state({**it.get_state(), "step": 2 * STEPS_PER_SHARD})
      with pytest.raises(StreamMismatchError, match=re.escape(f"shard {data.shards[2]}")):
        next(it)
      it.set_state({**it.get_state(), "step": 5})
      assert_trees_equal(next(it), expected[5])
  assert server.proc.returncode == 0, server.stderr()


def test_rewrite_in_place_is_refused_rename_after_open_serves_the_old_bytes(data):
  """Both workers have shards 1 and 2 open. Shard 1 rewritten in place: refused
  at once (the fstat after each read). Shard 2 renamed over: the open files
  still hold the old bytes, which both serve; a restarted worker opens the
  new file and refuses it."""
  expected = data.stream()
  structure = _structure(data.config)
  with LocalServer(data.config, workers=2) as server:

    def same(worker: int, step: int, answer: Any) -> None:
      assert_trees_equal(answer, expected[step], f"worker {worker} step {step}")

    opened: dict[int, set[int]] = {0: set(), 1: set()}  # worker -> shards it has read
    deadline = time.monotonic() + 60
    for step in itertools.cycle([10, 20, 13, 23, 16, 26]):
      if all(shards == {1, 2} for shards in opened.values()):
        break
      assert time.monotonic() < deadline, f"workers read shards {opened}"
      worker, answer = _ask(server.target, step, structure)
      same(worker, step, answer)
      opened[worker].add(step // STEPS_PER_SHARD)
    data.replace(1, "in place")
    data.replace(2, "rename")

    def judge(worker: int, step: int, answer: Any) -> None:
      if step < 2 * STEPS_PER_SHARD:
        assert _refused(answer, data.shards[1]), f"worker {worker} step {step}: {answer}"
      else:
        same(worker, step, answer)

    # Steps not asked before the change: those asked (10, 13, 16) may come
    # from a worker's batch cache, which holds the bytes read at the time.
    _ask_every_worker(server, range(11, 30, 3), structure, judge)

    victim = worker_pids(server)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (m := re.search(rf"worker (\d+) \(pid {victim}\)", server.stderr())):
      assert time.monotonic() < deadline, server.stderr()
      time.sleep(0.1)
    restarted = int(m.group(1))
    while len(worker_pids(server)) < 2:
      assert time.monotonic() < deadline, server.stderr()
      time.sleep(0.1)

    def after_restart(worker: int, step: int, answer: Any) -> None:
      if step < 2 * STEPS_PER_SHARD:
        assert _refused(answer, data.shards[1]), f"worker {worker} step {step}: {answer}"
      elif worker == restarted:
        assert _refused(answer, data.shards[2]), f"worker {worker} step {step}: {answer}"
      else:
        same(worker, step, answer)

    # Again steps not asked before (the survivor's cache holds those it served).
    _ask_every_worker(server, range(12, 30, 3), structure, after_restart)


def test_a_server_restarted_on_changed_files_has_another_fingerprint(data):
  expected = data.stream()
  with LocalServer(data.config, workers=1) as server:
    with RemoteDataset(server.target, "plain", G) as ds:
      it = iter(ds)
      assert_trees_equal(next(it), expected[0])
      state = it.get_state()
  # The embedded oracle, on the same files, fingerprints them the same.
  (before,) = EmbeddedBackend(data.config).describe("plain")
  assert state["config_fingerprint"] == before.config_fingerprint

  data.replace(0, "rename")
  changed = data.stream()
  assert changed[0]["image"].tobytes() != expected[0]["image"].tobytes()
  with LocalServer(data.config, workers=1) as server:
    with RemoteDataset(server.target, "plain", G) as ds:
      it = iter(ds)
      assert it.get_state()["config_fingerprint"] != state["config_fingerprint"]
      with pytest.raises(StreamMismatchError, match="config_fingerprint: saved"):
        it.set_state(state)
      assert_trees_equal(next(it), changed[0])  # the new bytes, under the new fingerprint
    with grpc.insecure_channel(server.target) as channel:
      request = pb.BatchRequest(dataset="plain", global_batch_size=G, shard_index=0,
                                shard_count=1, start_step=0, num_steps=1,
                                config_fingerprint=state["config_fingerprint"])
      with pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.ElevatorStub(channel).GetBatches(request, timeout=30))
      assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# In process, both readers: ours and ArrayRecord's (the fallback).

@pytest.fixture(params=["auto", "arrayrecord"])
def reader(request, monkeypatch) -> str:
  monkeypatch.setenv(shard_reader.READER_ENV, request.param)
  return request.param


def test_both_readers_refuse_a_changed_shard(data, reader):
  identities = shard_identity.shard_identities(data.shards)
  keys = list(range(0, 600, 37))  # every shard
  opened = dataset_lib.BatchedArrayRecordSource(data.shards, identities=identities)
  original = opened._getitems(keys)  # pylint: disable=protected-access
  data.replace(1, "rename")  # harmless to the open file
  assert opened._getitems(keys) == original  # pylint: disable=protected-access
  fresh = dataset_lib.BatchedArrayRecordSource(data.shards, identities=identities)
  assert fresh._getitems([0, 444]) == [original[0], original[12]]  # pylint: disable=protected-access
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {data.shards[1]} changed since the server "
                                     "started (mtime/footer differ)")):
    fresh._getitems([250])  # pylint: disable=protected-access
  data.replace(2, "in place")
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {data.shards[2]} changed")):
    opened._getitems([450])  # pylint: disable=protected-access


def test_a_file_the_globs_match_only_now_is_refused(data):
  config = load_config(data.config)
  recorded = shard_identity.record_identities(config)
  del recorded[data.shards[0]]  # as if it appeared after the server started
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {data.shards[0]} was not among")):
    dataset_lib.Datasets(config, identities=recorded)
