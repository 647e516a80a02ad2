"""The gRPC port under a hostile or very large load: calls whose request
never arrives, unauthenticated calls, half-sent messages, too many
connections and streams. Each case failed on 01acd88 (the worker before
these limits); a well-behaved client still reads the exact stream."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import h2.settings
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.client import RemoteDataset, Security, TransportOptions, describe
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto.limits import MAX_REQUEST_BYTES
from grain_elevator.server.serving.grpc_service import REQUEST_ARRIVAL_TIMEOUT_S, SERVICE_NAME
from grain_elevator.tools.bench.h2peer import H2Peer
from grain_elevator.tools.launcher import LocalServer
from helpers import assert_streams_equal, worker_pids

DESCRIBE = f"/{SERVICE_NAME}/Describe"
GET_BATCHES = f"/{SERVICE_NAME}/GetBatches"
CHECK = "/grpc.health.v1.Health/Check"


def _exact(server, config_path, kind: str = "grpc", **security) -> None:
  with RemoteDataset(server.target, "plain", 64, transport=TransportOptions(kind=kind),
                     security=Security(**security)) as ds:
    with RemoteDataset.embedded(config_path, "plain", 64) as local:
      assert assert_streams_equal(ds, local) == 15


def _health(server, timeout_s: float = 5.0) -> int:
  with grpc.insecure_channel(server.target,
                             options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=timeout_s).status


@contextlib.contextmanager
def _peers(server, n: int) -> Iterator[list[H2Peer]]:
  peers = [H2Peer(server.host, server.port) for _ in range(n)]
  try:
    yield peers
  finally:
    for p in peers:
      p.close()


def _wait_for_ends(peers: list[H2Peer], ids: list[list[int]], timeout_s: float) -> None:
  """Reads until every call in `ids` (per peer) has ended, or `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if all(set(i) <= set(p.statuses()) for p, i in zip(peers, ids)):
      return
    for p in peers:
      p.read(0.05)


def test_calls_whose_request_never_comes_are_cut_and_starve_nobody(config_path):
  # 64 calls that send headers and no message, on every method, more than
  # the worker's 20 request threads (on 01acd88: Describe timed out for
  # everyone until they left).
  with LocalServer(config_path, workers=1) as server, _peers(server, 4) as peers:
    ids = [[p.open_call(m) for m in (DESCRIBE, GET_BATCHES, CHECK) * 5] for p in peers]
    start = time.monotonic()
    (info,) = describe(server.target, "plain")
    assert info.name == "plain"
    assert time.monotonic() - start < 4 * REQUEST_ARRIVAL_TIMEOUT_S
    _exact(server, config_path)
    _wait_for_ends(peers, ids, 10 * REQUEST_ARRIVAL_TIMEOUT_S)
    for p, i in zip(peers, ids):
      ended = p.statuses()
      assert set(i) <= set(ended), f"calls never ended: {set(i) - set(ended)}"
      # CANCELLED; a health Check is refused at once instead (RESOURCE_EXHAUSTED)
      # while MAX_WAITING_PER_PEER of its peer's wait (server/serving/health.py).
      assert all(ended[k] in ("1", "RST 8") or (ended[k] == "8" and n % 3 == 2)
                 for n, k in enumerate(i)), ended
    assert "did not arrive within" in server.stderr()
    assert "Traceback" not in server.stderr()  # cut calls end quietly, health's too
    assert _health(server) == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("token") / "token"
  path.write_text("s3cret\n")
  return str(path)


def test_a_missing_or_wrong_token_is_refused_before_the_message(config_path, token_file):
  # On 01acd88 the refusal waited for the request message, so these calls,
  # which never send it, were never answered.
  with LocalServer(config_path, workers=1,
                   extra_args=("--auth-token-file", token_file)) as server, \
       _peers(server, 1) as (peer,):
    ids = [peer.open_call(DESCRIBE), peer.open_call(GET_BATCHES, token="wrong"),
           peer.open_call(GET_BATCHES, declared_bytes=1 << 20, send_bytes=1000)]
    _wait_for_ends([peer], [ids], REQUEST_ARRIVAL_TIMEOUT_S / 2)
    assert [peer.statuses().get(i) for i in ids] == ["16"] * 3  # UNAUTHENTICATED
    _exact(server, config_path, auth_token="s3cret")


@pytest.mark.parametrize("declared, ends_with", [
    (1 << 20, "8"),  # over the limit: RESOURCE_EXHAUSTED from its length prefix
    (MAX_REQUEST_BYTES - 1024, "1"),  # under it, never completed: CANCELLED
])
def test_half_sent_messages_cost_at_most_the_request_limit(config_path, declared, ends_with):
  # 400 calls that declare a request and send all of it that flow control
  # allows but the last bytes. On 01acd88 (1 MiB limit, BDP-sized windows)
  # each held ~0.7 MB, and 2,000 took a worker from 208 MB to 2.26 GB.
  with LocalServer(config_path, workers=1) as server, _peers(server, 20) as peers:
    (worker,) = worker_pids(server)
    before = psutil.Process(worker).memory_info().rss
    ids = [[p.open_call(DESCRIBE, declared_bytes=declared, send_bytes=declared - 1)
            for _ in range(20)] for p in peers]
    peak = 0
    for _ in range(10):
      for p in peers:
        p.read(0.02)
      peak = max(peak, psutil.Process(worker).memory_info().rss - before)
    calls = sum(map(len, ids))
    assert peak < 2 * calls * MAX_REQUEST_BYTES, f"{peak >> 20} MiB for {calls} calls"
    _wait_for_ends(peers, ids, 10 * REQUEST_ARRIVAL_TIMEOUT_S)
    for p, i in zip(peers, ids):
      assert [p.statuses().get(k) for k in i] == [ends_with] * len(i)
    _exact(server, config_path)


def test_streams_per_connection_and_connections_per_worker_are_capped(config_path):
  with LocalServer(config_path, workers=1, extra_args=(
      "--max-grpc-connections", "40", "--max-streams-per-connection", "8")) as server:
    with _peers(server, 1) as (peer,):
      deadline = time.monotonic() + 5
      while (h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS not in
             peer.conn.remote_settings and time.monotonic() < deadline):
        peer.read(0.1)
      assert peer.conn.remote_settings.max_concurrent_streams == 8
    (worker,) = worker_pids(server)
    held = []
    for _ in range(80):
      held.append(H2Peer(server.host, server.port))
    time.sleep(1.0)
    for p in held:
      try:
        p.read(0.01)
      except (ConnectionResetError, OSError):
        pass
    open_now = [c for c in psutil.Process(worker).net_connections("tcp")
                if c.laddr.port == server.port and c.status == psutil.CONN_ESTABLISHED]
    assert len(open_now) <= 40 + 2, len(open_now)
    for p in held:
      p.close()
    # Probes ride on connections too: with the cap full they were refused
    # like any newcomer (docs: deploy health probes accordingly).
    assert _health(server) == health_pb2.HealthCheckResponse.SERVING
    _exact(server, config_path)


def test_calls_one_after_another_on_one_connection_past_its_stream_limit(config_path):
  # Each call's stream must be retired when it ends, a request that does not
  # parse included: a context kept alive by the arrival watchdog, or gRPC's
  # own parse failure in a request stream, once kept them open, and the 9th
  # call on one connection was refused (REFUSED_STREAM).
  with LocalServer(config_path, workers=1,
                   extra_args=("--max-streams-per-connection", "8")) as server:
    with grpc.insecure_channel(server.target) as channel:
      stub = pb_grpc.ElevatorStub(channel)
      request = pb.BatchRequest(dataset="plain", global_batch_size=8, shard_count=1,
                                num_steps=1)
      garbage = channel.unary_unary(DESCRIBE)  # bytes that parse as no request
      for _ in range(4 * 8):
        stub.Describe(pb.DescribeRequest(dataset="plain"), timeout=10)
        assert len(list(stub.GetBatches(request, timeout=10))) == 1
        with pytest.raises(grpc.RpcError) as info:
          garbage(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a grain_elevator.v1.DescribeRequest" in info.value.details()
    assert "Traceback" not in server.stderr()


def test_health_says_not_serving_while_no_request_thread_is_free():
  # The worker's request threads all held (by anything: on 01acd88, 24
  # header-only calls did it): a Describe would wait, so health must stop
  # saying SERVING (on 01acd88 it said SERVING throughout), and say it
  # again once a thread frees. A real gRPC server, its real health service.
  # The health port hears it through the board (server/process/health_board.py).
  import multiprocessing  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.process.health_board import HealthBoard  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.serving import health as health_lib  # pylint: disable=g-import-not-at-top
  board = HealthBoard(multiprocessing.get_context("spawn"), 1)
  threads = futures.ThreadPoolExecutor(2)
  server = grpc.server(futures.ThreadPoolExecutor(4))
  health = health_lib.Health(("",), report=board.slot(0))
  health.add_to_server(server)
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  health.publish()
  health.watch_pool(threads)
  release = threading.Event()
  try:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
      stub = health_pb2_grpc.HealthStub(channel)

      def status_within(want: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
          if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == want:
            return True
          time.sleep(0.1)
        return False

      assert status_within(health_lib.SERVING, 5)
      assert board.reasons() == []
      for _ in range(2):
        threads.submit(release.wait)
      assert status_within(health_lib.NOT_SERVING, 4 * health_lib.PROBE_TIMEOUT_S)
      assert board.reasons() == ["worker 0 has no free request thread"]
      release.set()
      assert status_within(health_lib.SERVING, 4 * health_lib.PROBE_TIMEOUT_S)
      assert board.reasons() == []
  finally:
    release.set()
    health.stop()
    server.stop(None)
    threads.shutdown()
