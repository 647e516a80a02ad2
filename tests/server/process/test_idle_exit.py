"""`elevator serve --idle-exit-s N`: a per-job data tier exits cleanly once its
job has stopped asking, and not while requests keep coming or one is still
streaming. Health checks do not keep it alive (a kubelet probes forever)."""

from __future__ import annotations

import itertools
import pathlib
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.pipelines import examples
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.tools.testing.launcher import LocalServer
import datasets

pytestmark = pytest.mark.slow  # servers waiting out idle limits


def _health(target: str) -> None:
  """A probe as `elevator health` makes one (a Check on a connection of its
  own), without a fresh interpreter per probe; whether it answers is not
  the point (the server may be stopping)."""
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    try:
      health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    except grpc.RpcError:
      pass


def test_exits_zero_after_the_last_request_despite_health_checks(config_path):
  with LocalServer(config_path, workers=2, extra_args=["--idle-exit-s", "3"]) as server:
    with RemoteDataset(server.target, "plain", 100, prefetch=0) as ds:
      it = iter(ds)
      for _ in range(6):  # requests every ~0.5 s: well inside the idle limit
        next(it)
        time.sleep(0.5)
        assert server.proc.poll() is None, "exited while requests were coming"
    # The job is gone; only probes remain.
    deadline = time.monotonic() + 120
    while server.proc.poll() is None and time.monotonic() < deadline:
      _health(server.target)
      time.sleep(0.3)
    assert server.proc.wait(30) == 0
    out = server.proc.stdout.read()
  assert "no request for 3s (--idle-exit-s): stopping" in out
  assert "elevator: stopped" in out


def test_a_bad_idle_exit_is_refused(config_path, elevator):
  """Refused before anything starts, so no fresh interpreter is needed."""
  code, _, err = elevator("serve", "--config", config_path, "--idle-exit-s", "0")
  assert code == 2 and "idle_exit_s must be > 0" in err


# 3,000 records of 12 KiB, 60 steps of 600 KiB in one request: 37 MB, far
# more than the client's flow-control window and socket buffers, so the
# server is still sending long after the idle limit.
BIG = {"height": 64, "width": 64, "channels": 3}
BIG_G, BIG_STEPS, IDLE_S = 50, 60, 2


def _big_config(root: pathlib.Path) -> str:
  examples.write_image_shards(str(root / "shards"), num_records=BIG_G * BIG_STEPS,
                              num_shards=2, **BIG)
  return datasets.write_config(root / "elevator.toml",
                               big=datasets.images("shards/train-*.array_record", image=BIG,
                                                   shuffle=False))


def _describe_on_another_worker(target: str, worker: int) -> None:
  """A short request that lands on a worker other than `worker` (new
  connections until one does): its end must not hide the other's stream."""
  for _ in range(200):
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
      answer = pb_grpc.ElevatorStub(ch).Describe(pb.DescribeRequest(dataset="big"), timeout=30)
    if answer.server.worker_index != worker:
      return
  raise AssertionError("every connection reached one worker")


def test_a_request_still_streaming_keeps_the_server_up(tmp_path):
  """One request whose client reads slowly streams for several times the
  idle limit: it gets every step, the server goes on serving others meanwhile
  (not shutting down), and it exits 0 only once the stream has ended."""
  config = _big_config(tmp_path)
  (info,) = EmbeddedBackend(config).describe("big")
  args = ["--idle-exit-s", str(IDLE_S), "--grace-s", "0.5"]  # a stop would cut the stream
  with LocalServer(config, workers=2, extra_args=args) as server:
    with grpc.insecure_channel(server.target) as channel:
      stub = pb_grpc.ElevatorStub(channel)
      worker = stub.Describe(pb.DescribeRequest(dataset="big"), timeout=30).server.worker_index
      request = pb.BatchRequest(dataset="big", global_batch_size=BIG_G, shard_index=0,
                                shard_count=1, start_step=0, num_steps=BIG_STEPS)
      began, asked_late = time.monotonic(), False
      for step, batch in zip(itertools.count(), stub.GetBatches(request, timeout=300)):
        if step == 1:
          _describe_on_another_worker(server.target, worker)
        elif not asked_late and time.monotonic() - began > 2 * IDLE_S:
          _describe_on_another_worker(server.target, -1)  # served: not stopping
          asked_late = True
          # Past the idle limit and its check, mid-stream: still up. (Not
          # after the stream: the server may stop IDLE_S after it sent the
          # last step, while a slow client still reads what it buffered.)
          assert server.proc.poll() is None, "exited while a request was streaming"
        got = wire.decode_batch(batch.SerializeToString(), info.element_spec.structure)[1]
        assert batch.step == step
        np.testing.assert_array_equal(got["id"], np.arange(step * BIG_G, (step + 1) * BIG_G))
        time.sleep(0.12)  # a slow reader: the server waits on its window
      took = time.monotonic() - began
      assert step == BIG_STEPS - 1  # every step came: the stream was not cut by a stop
    assert asked_late, f"the stream took only {took:.1f}s"
    assert server.proc.wait(120) == 0, server.stderr()
    out = server.proc.stdout.read()
  assert f"no request for {IDLE_S}s (--idle-exit-s): stopping" in out
