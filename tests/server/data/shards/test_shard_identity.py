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
import time
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, ShardChangedError, StreamMismatchError
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.pipelines import examples
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.server.data import registry
from grain_elevator.server.data.config import load_config
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.shards import identity as shard_identity
from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server import Server, ServerOptions
import datasets
from helpers import assert_trees_equal, wait_for

G, STEPS_PER_SHARD, NUM_SHARDS = 20, 10, 3
IMAGE = datasets.IMAGE
PLAIN = datasets.images("shards/train-*.array_record", shuffle=False)
CONFIG = datasets.config_text(plain=PLAIN)


def _server(config: str, workers: int) -> Server:
  """A private in-process server: each test changes its shards under it."""
  return Server(config, ServerOptions(port=0, workers=workers))


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
  for attempt in itertools.count():
    with grpc.insecure_channel(target, options=options) as channel:
      stub = pb_grpc.ElevatorStub(channel)
      try:
        worker = stub.Describe(pb.DescribeRequest(dataset="plain"),
                               timeout=30).server.worker_index
      except grpc.RpcError as e:
        # On a loaded machine a fresh connection is now and then reset before
        # its first answer ("Stream removed", seen at 791bbd7 too; 1,500 new
        # connections in a row were not). Clients retry UNAVAILABLE; so does this.
        if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == 4:
          raise
        continue
      request = pb.BatchRequest(dataset="plain", global_batch_size=G, shard_index=0,
                                shard_count=1, start_step=step, num_steps=1)
      try:
        (batch,) = stub.GetBatches(request, timeout=30)
      except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE and attempt < 4:  # reset later: the same
          continue
        return worker, e
      return worker, wire.decode_batch(batch.SerializeToString(), structure)[1]
  raise AssertionError("not reached")


def _refused(answer: Any, shard: str) -> bool:
  return (isinstance(answer, grpc.RpcError)
          and answer.code() == grpc.StatusCode.FAILED_PRECONDITION
          and f"shard {shard} changed since the server started" in answer.details())


def _ask_every_worker(server: Server, steps: range, structure: Any,
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
      pytest.fail(f"in 60 s only workers {sorted(seen)} answered")
    if k >= 2 * len(steps):
      time.sleep(0.05)


def _shard_steps(shard: int) -> range:
  return range(shard * STEPS_PER_SHARD, (shard + 1) * STEPS_PER_SHARD)


def test_workers_refuse_shards_replaced_before_they_open_them(data):
  expected = data.stream()
  structure = _structure(data.config)
  with _server(data.config, workers=2) as server:
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
    assert len(server.worker_pids()) == 2  # both workers serve on
  assert not server.worker_pids()  # a clean stop


def test_rewrite_in_place_is_refused_rename_after_open_serves_the_old_bytes(data,
                                                                           grain_elevator_logs):
  """Both workers have shards 1 and 2 open. Shard 1 rewritten in place: refused
  at once (the fstat after each read). Shard 2 renamed over: the open files
  still hold the old bytes, which both serve; a restarted worker opens the
  new file and refuses it."""
  expected = data.stream()
  structure = _structure(data.config)
  with _server(data.config, workers=2) as server:

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

    victim = server.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    died = lambda: [m for line in grain_elevator_logs.messages
                    if (m := re.search(rf"worker (\d+) \(pid {victim}\)", line))]
    wait_for(died, f"the supervisor to log the death of pid {victim}")
    restarted = int(died()[0].group(1))
    wait_for(lambda: len(server.worker_pids()) == 2, f"worker {restarted} to be restarted")

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
  with _server(data.config, workers=1) as server:
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
  with _server(data.config, workers=1) as server:
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
  opened = BatchedArrayRecordSource(data.shards, identities=identities)
  original = opened._getitems(keys)  # pylint: disable=protected-access
  data.replace(1, "rename")  # harmless to the open file
  assert opened._getitems(keys) == original  # pylint: disable=protected-access
  fresh = BatchedArrayRecordSource(data.shards, identities=identities)
  assert fresh._getitems([0, 444]) == [original[0], original[12]]  # pylint: disable=protected-access
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {data.shards[1]} changed since the server "
                                     "started (mtime/ctime/inode/footer differ)")):
    fresh._getitems([250])  # pylint: disable=protected-access
  data.replace(2, "in place")
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {data.shards[2]} changed")):
    opened._getitems([450])  # pylint: disable=protected-access


def test_a_file_the_globs_match_only_now_is_refused(data):
  config = load_config(data.config)
  recorded = shard_identity.record_identities(config)
  del recorded.shards[data.shards[0]]  # as if it appeared after the server started
  opened = registry.Datasets(config, identities=recorded)  # a worker still starts
  for _ in range(2):  # and refuses the dataset on every request
    with pytest.raises(ShardChangedError,
                       match=re.escape(f"shard {data.shards[0]} was not among")):
      opened.get("plain")


# Rewrites that put the size and mtime back (os.utime, cp -p, rsync -a): the
# ctime, which no user can set, still tells.

def _write_fixed_size_shard(path: str, seed: int) -> None:
  """One shard of G * STEPS_PER_SHARD records of one size, stored
  uncompressed: another seed gives other bytes in the same layout, so a file
  of exactly the same size that our reader reads from its old footer."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  shape = (IMAGE["height"], IMAGE["width"], IMAGE["channels"])
  writer = ArrayRecordWriter(path, "group_size:1,uncompressed")
  for i in range(G * STEPS_PER_SHARD):
    writer.write(examples.encode_record(i, int(rng.integers(10)),
                                        rng.integers(0, 256, shape, np.uint8)))
  writer.close()


def _rewrite_keeping_size_and_mtime(path: str, new_bytes: bytes) -> None:
  before = os.stat(path)
  with open(path, "r+b") as f:
    f.write(new_bytes)
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
  after = os.stat(path)
  assert ((after.st_ino, after.st_size, after.st_mtime_ns)
          == (before.st_ino, before.st_size, before.st_mtime_ns))


def test_a_rewrite_in_place_with_the_old_mtime_put_back_is_refused(tmp_path):
  """The worker has the shard open; it is rewritten in place with other rows
  of the same size, its mtime put back. A step not served before is refused
  naming the shard, never served with the new rows under the old fingerprint."""
  (tmp_path / "shards").mkdir()
  shard = str(tmp_path / "shards" / "train-00000-of-00001.array_record")
  _write_fixed_size_shard(shard, seed=0)
  _write_fixed_size_shard(str(tmp_path / "other.array_record"), seed=1)
  other = (tmp_path / "other.array_record").read_bytes()
  assert len(other) == os.path.getsize(shard)
  config = str(tmp_path / "elevator.toml")
  pathlib.Path(config).write_text(CONFIG)
  structure = _structure(config)
  with RemoteDataset.embedded(config, "plain", G) as ds:
    expected = list(ds)
  with _server(config, workers=1) as server:
    _, answer = _ask(server.target, 0, structure)
    assert_trees_equal(answer, expected[0])  # the worker has opened the shard
    time.sleep(0.01)  # the rewrite's ctime must differ from the recorded one
    _rewrite_keeping_size_and_mtime(shard, other)
    for step in (1, STEPS_PER_SHARD - 1):  # not served before: not in the batch cache
      _, answer = _ask(server.target, step, structure)
      assert _refused(answer, shard), f"step {step}: {answer}"
      assert "(ctime differs)" in answer.details()
    assert len(server.worker_pids()) == 1  # the worker serves on
  assert not server.worker_pids()  # a clean stop


def test_a_shard_opened_after_such_a_rewrite_is_refused(tmp_path):
  """A shard bigger than the hashed tail, rewritten before its first open
  with the tail, size and mtime as recorded: its ctime differs."""
  path = str(tmp_path / "shard")
  pathlib.Path(path).write_bytes(os.urandom(3 * shard_identity.IDENTITY_TAIL_BYTES))
  recorded = shard_identity.shard_identities([path])[path]
  shard_identity.CheckedFile(path, recorded).close()  # as recorded: opens
  time.sleep(0.01)
  _rewrite_keeping_size_and_mtime(path, os.urandom(1024))
  assert shard_identity.shard_identities([path])[path].tail_hash == recorded.tail_hash
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"shard {path} changed since the server started "
                                     "(ctime differs)")):
    shard_identity.CheckedFile(path, recorded)
  # The stream fingerprint covers the bytes, not the ctime: equal to a copy's.
  copy = str(tmp_path / "copy")
  shutil.copy2(path, copy)
  a, b = shard_identity.shard_identities([path, copy]).values()
  assert (a.size, a.mtime_ns, a.tail_hash) == (b.size, b.mtime_ns, b.tail_hash)


def test_a_worker_opening_a_dataset_whose_first_shard_changed_refuses_only_it(data):
  """Opening a dataset reads its record 0: a worker restarted after shard 0
  changed refuses the dataset on every request and opens the others (it
  used to fail to start, again and again)."""
  datasets.write_config(data.config, plain=PLAIN,
                        same={**PLAIN, "paths": ["other/train-*.array_record"]})
  config = load_config(data.config)
  recorded = shard_identity.record_identities(config)
  data.replace(0, "rename")
  opened = registry.Datasets(config, identities=recorded)
  assert sorted(opened.opened()) == ["same"]
  for _ in range(2):
    with pytest.raises(ShardChangedError, match=re.escape(f"shard {data.shards[0]} changed")):
      opened.get("plain")
