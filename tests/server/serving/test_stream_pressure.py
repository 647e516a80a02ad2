"""A stream dataset served to hostile or buggy clients, on a real server:
a global batch over the limit is refused before a record is read, a
request that goes away stops its worker inside the batch, refused and made-up
positions are answered INVALID_ARGUMENT without echo and logged once a
period, a pipeline's failures likewise, and the worker goes on serving the
exact stream to everyone else.

The tests that read the worker's log share one `elevator serve` (an
in-process server's workers log where no test can read); the others read
the session's in-process servers of this config (`serve`), whose workers
import the pipelines from this process's path."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Iterator

import grpc
import psutil
import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.pipelines import examples
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.server.serving.options import DEFAULT_MAX_STREAM_BATCH_BYTES
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import assert_streams_equal, wait_for, worker_pids
import datasets

SIDE = 32  # rows of 32x32x3 images: about 3 KiB
SLOW_S = 0.002  # what one element of "slow" costs
_WAIT_S = 120.0

_PIPES = '''
import os
import time
from grain_elevator.pipelines import examples


class _Noted:
  """Passes every record, noting its id in out/<pid>.txt after SLOW_S."""

  def __init__(self, out, sleep_s):
    self.out, self.sleep_s = out, sleep_s

  def __call__(self, record):
    time.sleep(self.sleep_s)
    with open(os.path.join(self.out, f"{os.getpid()}.txt"), "a") as f:
      f.write(f"{int(record['id'])}\\n")
    return True


def slow(ds, *, out, sleep_s, **image):
  return examples.decode_images(ds, **image).filter(_Noted(out, sleep_s))


def failing(ds, **image):
  def check(r):
    if int(r["id"]) % 50 == 7:
      raise ValueError(f"record {int(r['id'])} is unreadable")
    return r
  return examples.decode_images(ds, **image).filter(lambda r: True).map(check)
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("pressure")
  examples.write_image_shards(str(root / "shards"), num_records=600, num_shards=2,
                              height=SIDE, width=SIDE, channels=3)
  (root / "pressure_pipes.py").write_text(_PIPES)
  (root / "notes").mkdir()
  image = {"height": SIDE, "width": SIDE, "channels": 3}
  datasets.write_config(
      root / "elevator.toml",
      # a filter (9 labels of 10): a stream of 3 KiB rows
      big=datasets.images(pipeline=datasets.DECODE_SOME, image=image, seed=5, num_epochs=0,
                          options={"labels": list(range(9))}),
      # each element costs SLOW_S and is noted
      slow=datasets.images(pipeline="pressure_pipes:slow", image=image, seed=6, num_epochs=0,
                           options={"out": str(root / "notes"), "sleep_s": SLOW_S}),
      # record ids 7, 57, 107, ... raise
      failing=datasets.images(pipeline="pressure_pipes:failing", image=image, shuffle=False,
                              num_epochs=0))
  # Embedded mode and in-process servers' workers (which take this
  # process's path) import the pipelines.
  sys.path.insert(0, str(root))
  return root


@pytest.fixture(scope="module")
def logged(root: pathlib.Path) -> Iterator[LocalServer]:
  """One `elevator serve` worker, for the tests that read its log (each
  reads what it wrote)."""
  with LocalServer(str(root / "elevator.toml"), workers=1, env=_env(root)) as server:
    yield server


def _env(root: pathlib.Path) -> dict[str, str]:
  return {"PYTHONPATH": str(root)}


def _fingerprint(stub, name: str) -> str:
  (info,) = stub.Describe(pb.DescribeRequest(dataset=name), timeout=30).datasets
  return info.config_fingerprint


def _get(stub, timeout_s: float = 30.0, **request) -> list[pb.Batch]:
  return list(stub.GetBatches(pb.BatchRequest(**request), timeout=timeout_s))


def _stub(target: str):
  channel = grpc.insecure_channel(target)
  return channel, pb_grpc.ElevatorStub(channel)


def _rejects(call) -> grpc.RpcError:
  with pytest.raises(grpc.RpcError) as e:
    call()
  return e.value


def test_a_global_batch_over_the_limit_is_refused_before_a_record_is_read(root, serve):
  """One row of a stream costs its whole global batch: G itself is bounded."""
  limit = 1_000_000
  server = serve(root / "elevator.toml", max_stream_batch_bytes=limit)
  channel, stub = _stub(server.target)
  with channel:
    g_over = limit // 3000 + 64  # rows of over 3,000 bytes: over the limit
    error = _rejects(lambda: _get(stub, dataset="big", global_batch_size=g_over,
                                  shard_index=0, shard_count=g_over, num_steps=1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over the server's --max-stream-batch-bytes of {limit}" in error.details()
  with RemoteDataset(server.target, "big", 64) as remote, \
      RemoteDataset.embedded(str(root / "elevator.toml"), "big", 64) as local:
    r, l = iter(remote), iter(local)
    assert assert_streams_equal([next(r) for _ in range(5)], [next(l) for _ in range(5)]) == 5
  server = serve(root / "elevator.toml")
  channel, stub = _stub(server.target)
  with channel:  # the default bound: G = 2^20 rows of 3 KiB is refused, not made
    g = 1 << 20
    error = _rejects(lambda: _get(stub, dataset="big", global_batch_size=g, shard_index=0,
                                  shard_count=g, num_steps=1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"--max-stream-batch-bytes of {DEFAULT_MAX_STREAM_BATCH_BYTES}" in error.details()


def _noted(root: pathlib.Path) -> int:
  return sum(len(p.read_text().splitlines()) for p in (root / "notes").glob("*.txt"))


def _settled(root: pathlib.Path, quiet_s: float = 1.0) -> int:
  """The count of noted elements once it has not grown for `quiet_s`."""
  deadline = time.monotonic() + _WAIT_S
  last = _noted(root)
  while time.monotonic() < deadline:
    time.sleep(quiet_s)
    now = _noted(root)
    if now == last:
      return now
    last = now
  raise AssertionError(f"the worker is still producing after {_WAIT_S:.0f} s ({last} elements)")


def test_a_request_that_goes_away_stops_its_worker_inside_the_batch(root, serve):
  """G = 3,000 rows of elements costing SLOW_S each, asked for one row with
  a 1 s deadline: the worker stops within an element of the deadline, not
  after the whole batch (it used to make all 3,000)."""
  g = 3000
  server = serve(root / "elevator.toml")
  channel, stub = _stub(server.target)
  with channel:
    fingerprint = _fingerprint(stub, "slow")
    before = _settled(root)  # what start-up computed
    error = _rejects(lambda: _get(stub, 1.0, dataset="slow", global_batch_size=g,
                                  shard_index=0, shard_count=g, num_steps=1,
                                  config_fingerprint=fingerprint))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    made = _settled(root) - before
    assert made < g // 2, f"{made} of {g} elements made after the deadline passed"
  # The worker threw that half-made batch away: the stream is exact.
  with RemoteDataset(server.target, "slow", 8) as remote, \
      RemoteDataset.embedded(str(root / "elevator.toml"), "slow", 8) as local:
    r, l = iter(remote), iter(local)
    assert assert_streams_equal([next(r) for _ in range(3)], [next(l) for _ in range(3)]) == 3


def _log_from(server: LocalServer, offset: int, text: str) -> str:
  """The server's log from `offset` on, once it holds `text` (its reader
  thread reads the server's stderr a moment after the server writes it)."""
  wait_for(lambda: text in server.stderr()[offset:], f"the server to log {text!r}")
  return server.stderr()[offset:]


def test_positions_not_of_the_stream_are_refused_without_echo_and_logged_once(logged):
  """A trainer retrying a stale cursor in a loop: each request refused, the
  log one line a period, and the worker's sessions and memory unchanged."""
  server = logged
  offset = len(server.stderr())
  channel, stub = _stub(server.target)
  with channel:
    (info,) = stub.Describe(pb.DescribeRequest(dataset="big"), timeout=30).datasets
    start = json.loads(info.stream_start)
    (worker,) = map(psutil.Process, worker_pids(server))
    _get(stub, dataset="big", global_batch_size=16, shard_count=1, num_steps=2)
    rest = worker.memory_info().rss
    bad = [{**start, "secret_evil_key": 1},  # unknown keys are not echoed back
           {**start, "next_index": -4},
           {**start, "next_index": "4"},
           {**start, "next_index": 10**19}]
    for i in range(300):
      state = json.dumps(bad[i % len(bad)])
      error = _rejects(lambda: _get(stub, dataset="big", global_batch_size=16,
                                    shard_count=1, num_steps=1, stream_state=state))
      assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
      assert "not a position of this stream" in error.details()
      assert "secret_evil_key" not in error.details()
    grown = worker.memory_info().rss - rest
    assert grown < 32 << 20, f"300 refused positions grew the worker by {grown >> 20} MiB"
    # Still serving, exactly.
    got = _get(stub, dataset="big", global_batch_size=16, shard_count=1, num_steps=2)
    assert len(got) == 2
  log = _log_from(server, offset, "not a position of this stream")
  lines = [l for l in log.splitlines() if "not a position of this stream" in l]
  assert 1 <= len(lines) <= 10, lines[:12]
  assert "secret_evil_key" not in server.stderr()


def test_a_pipeline_failing_again_and_again_is_logged_once_a_period(logged):
  """DATA_LOSS each time, with one traceback per period, not one per request."""
  server = logged
  offset = len(server.stderr())
  channel, stub = _stub(server.target)
  with channel:
    for _ in range(40):
      error = _rejects(lambda: _get(stub, dataset="failing", global_batch_size=8,
                                    shard_count=1, num_steps=1))
      assert error.code() == grpc.StatusCode.DATA_LOSS
      assert "record 7 is unreadable" in error.details()
  log = _log_from(server, offset, "Traceback")
  assert 1 <= log.count("Traceback") <= 4, log[-3000:]
