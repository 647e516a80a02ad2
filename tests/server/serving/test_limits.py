"""Bounded work per worker, and a clean SIGTERM (the one test that needs an
`elevator serve` process: it signals the supervisor and reads its log)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.client import InvalidRequestError, RemoteDataset, RetryPolicy
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import (assert_streams_equal, assert_trees_equal, busy_cpu_rate, cpu_rate_over,
                     oracle_batch, wait_for, wait_for_log)

pytestmark = pytest.mark.slow  # limits filled, servers drained


def _own_channel(server) -> grpc.Channel:
  """A channel with a TCP connection of its own."""
  return grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])


def _endless(stub, g: int = 256):
  """A stream that holds its RPC slot open, read as fast as it comes (a
  stream that is not read yields its slot to a newcomer after a second:
  tests/server/serving/test_hostile_clients.py)."""
  call = stub.GetBatches(pb.BatchRequest(
      dataset="forever", global_batch_size=g, shard_count=1, start_step=0,
      num_steps=1_000_000), timeout=60)
  next(call)
  threading.Thread(target=_drain, args=(call,), daemon=True).start()
  return call


def _drain(call) -> None:
  try:
    for _ in call:
      pass
  except grpc.RpcError:
    pass  # cancelled by the test


def test_over_the_concurrency_limit_is_resource_exhausted_and_clients_back_off(
    config_path):
  with Server(config_path, ServerOptions(port=0, workers=1,
                                         max_concurrent_requests=1)) as server:
    with grpc.insecure_channel(server.target) as channel:
      stub = pb_grpc.ElevatorStub(channel)
      with _own_channel(server) as other:
        describe = pb_grpc.ElevatorStub(other).Describe
        describe(pb.DescribeRequest(), timeout=30)  # connected while the slot is free
        for _ in range(10):
          held = _endless(stub)
          try:
            describe(pb.DescribeRequest(), timeout=30)
            code = grpc.StatusCode.OK
          except grpc.RpcError as e:
            code = e.code()
          if code != grpc.StatusCode.OK:
            break
          # Admitted only by taking the held stream's slot: one past its slice
          # or stalled yields to a newcomer (server/serving/admission.py), as
          # a loaded machine can make it. It must have ended CANCELLED.
          assert held.code() == grpc.StatusCode.CANCELLED, "admitted past the limit"
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The health check is not a request: it answers whatever the load.
        health = health_pb2_grpc.HealthStub(other).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
      # A client arriving now backs off and retries until the slot frees.
      ds = RemoteDataset(server.target, "plain", 64, prefetch=2,
                         retry=RetryPolicy(timeout_s=30))
      threading.Timer(1.0, held.cancel).start()
      with ds:
        with RemoteDataset.embedded(config_path, "plain", 64) as local:
          assert assert_streams_equal(ds, local) == 15


def test_message_size_limit_is_checked_before_building(serve):
  server = serve(workers=1, max_message_bytes=10000)
  with pytest.raises(InvalidRequestError,
                     match=r"256 rows of 68 bytes is 17408 bytes per step, over the "
                           r"server's --max-message-bytes of 10000"):
    next(iter(RemoteDataset(server.target, "aug2", 256)))
  with RemoteDataset(server.target, "aug2", 128) as ds:  # 8704 bytes: fine
    assert next(iter(ds))["image"].shape == (128, 4, 4, 3)


def test_sigterm_refuses_new_requests_and_finishes_in_flight_ones(config_path, oracle):
  server = LocalServer(config_path, workers=1, extra_args=("--grace-s", "20"))
  try:
    channel = grpc.insecure_channel(server.target)
    stub = pb_grpc.ElevatorStub(channel)
    call = stub.GetBatches(pb.BatchRequest(
        dataset="plain", global_batch_size=8, shard_count=1, start_step=0,
        num_steps=120), timeout=60)
    first = next(call)
    server.proc.send_signal(signal.SIGTERM)
    wait_for_log(server, "stopping: new requests are refused")
    with _own_channel(server) as fresh:
      with pytest.raises(grpc.RpcError) as info:
        pb_grpc.ElevatorStub(fresh).Describe(pb.DescribeRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    batches = [first, *call]  # the in-flight stream still completes, exactly
    (spec,) = oracle.describe("plain")
    assert [b.step for b in batches] == list(range(120))
    for b in batches:
      _, got = wire.decode_batch(b.SerializeToString(), spec.element_spec.structure)
      assert_trees_equal(got, oracle_batch(oracle, "plain", b.step, 8), f"step {b.step}")
    assert server.proc.wait(60) == 0
    channel.close()
  finally:
    server.stop()


def test_a_cancelled_stream_stops_the_server_computing(config_path):
  import psutil
  with Server(config_path, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
    (pid,) = server.worker_pids()
    worker = psutil.Process(pid)
    with grpc.insecure_channel(server.target) as channel:
      call = pb_grpc.ElevatorStub(channel).GetBatches(pb.BatchRequest(
          dataset="forever", global_batch_size=512, shard_count=1, start_step=0,
          num_steps=1_000_000), timeout=120)

      def read_all():
        try:
          for _ in call:
            pass
        except grpc.RpcError as e:
          assert e.code() == grpc.StatusCode.CANCELLED

      drain = threading.Thread(target=read_all, daemon=True)
      drain.start()
      busy = busy_cpu_rate(worker)
      call.cancel()
      # The server ended the request (its metrics say so), whenever a loaded
      # machine lets it notice; then what it still computes is measured.
      wait_for(lambda: top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=30)[
          ("elevator_inflight_requests", ())] == 0, "the server to end the cancelled request")
      time.sleep(0.5)
      idle = cpu_rate_over(worker, 1.5)
    assert idle < busy / 4, f"worker still busy after cancel: {idle:.2f} vs {busy:.2f} CPU-s/s"
