"""Clients that hold slots without reading, idle sockets, silent peers: the
health check still answers, and a well-behaved client with default settings
still reads the exact stream.

Each test that holds a server's slots starts an in-process server of its
own (~0.4 s); the two that read the worker's log share one `elevator serve`
(an in-process server's workers log where no test can read)."""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import time
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import framing
from grain_elevator.server import Server
from grain_elevator.server.serving.options import ServerOptions
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import assert_streams_equal, wait_for, wait_for_log

pytestmark = pytest.mark.slow  # floods of connections, slow peers

LONG_SLOTS = ServerOptions().max_concurrent_requests // 2
ENDLESS = pb.BatchRequest(dataset="forever", global_batch_size=256, shard_count=1,
                          start_step=0, num_steps=1_000_000)


def _health(server, timeout_s: float = 20.0) -> float:
  """Seconds the health check took; it must answer SERVING (within less
  than the write timeout that would free a held request thread)."""
  with grpc.insecure_channel(server.target,
                             options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
    start = time.monotonic()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=timeout_s)
    took = time.monotonic() - start
  assert reply.status == health_pb2.HealthCheckResponse.SERVING
  return took


def _exact(server, config_path, kind: str = "auto") -> None:
  with RemoteDataset(server.target, "plain", 64, transport=TransportOptions(kind=kind)) as ds:
    with RemoteDataset.embedded(config_path, "plain", 64) as local:
      assert assert_streams_equal(ds, local) == 15


@contextlib.contextmanager
def _unread_grpc_streams(server, n: int, *, small_window: bool = False) -> Iterator[list]:
  """`n` GetBatches calls nobody reads: each holds a request slot. With
  `small_window` the channel keeps HTTP/2's initial 64 KiB window (no
  bandwidth probing grows it): a call stalls after a few batches, not
  after megabytes."""
  channel = grpc.insecure_channel(server.target,
                                  options=[("grpc.http2.bdp_probe", 0)] if small_window else [])
  calls = [pb_grpc.ElevatorStub(channel).GetBatches(ENDLESS, timeout=300) for _ in range(n)]
  try:
    yield calls
  finally:
    for call in calls:
      call.cancel()
    channel.close()


def _bulk_socket(server, *, greet: bool = True) -> socket.socket:
  s = socket.create_connection((server.host, server.bulk_port), timeout=10)
  if greet:
    s.sendall(framing.MAGIC)
    assert s.recv(len(framing.MAGIC), socket.MSG_WAITALL) == framing.MAGIC
  return s


@contextlib.contextmanager
def _unread_bulk_requests(server, n: int) -> Iterator[list[socket.socket]]:
  """`n` bulk connections that ask for an endless stream and never read it:
  all greeted first, then the requests sent at once (so they arrive
  together, not spread over however long a loaded machine takes to greet)."""
  socks = []
  try:
    for _ in range(n):
      s = _bulk_socket(server)
      s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
      socks.append(s)
    payload = pb.BulkRequest(request=ENDLESS).SerializeToString()
    for s in socks:
      s.sendall(framing.frame(framing.REQUEST, payload))
    yield socks
  finally:
    for s in socks:
      s.close()


@pytest.fixture
def fresh_server(config_path: str) -> Iterator[Server]:
  """A worker of its own with the default limits (16 request slots): no
  slot still held by an earlier test's streams, whose cancellation a loaded
  machine may not have processed yet."""
  with Server(config_path, ServerOptions(port=0, workers=1)) as s:
    yield s


@pytest.fixture(scope="module")
def logged(config_path: str) -> Iterator[LocalServer]:
  """`elevator serve` for the two tests that read its log: 64 bulk
  connections at most and a 2 s write timeout (no other test here reads
  slowly enough, nor batches large enough, for it to matter)."""
  with LocalServer(config_path, workers=1, extra_args=(
      "--max-bulk-connections", "64", "--write-timeout-s", "2")) as s:
    yield s


@pytest.mark.parametrize("kind", ["grpc", "auto"])
def test_unread_grpc_streams_on_every_slot(fresh_server, config_path, kind):
  server = fresh_server
  with _unread_grpc_streams(server, 32) as calls:
    # Those past half the slots are refused, the rest fill their windows and
    # stall. A newcomer may also take the slot of one that stalled or ran past
    # its slice (server/serving/admission.py), which a loaded machine makes
    # happen: that one ends CANCELLED instead. Either way, LONG_SLOTS stream.
    wait_for(lambda: sum(c.done() for c in calls) >= 32 - LONG_SLOTS,
             "the calls past half the slots to end")
    for c in calls:
      c.initial_metadata()  # the server has answered every call: streaming, or ended
    ended = [c.code() for c in calls if c.done()]
    assert len(ended) == 32 - LONG_SLOTS, ended  # endless streams get half the slots
    assert set(ended) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, ended
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in ended
    _health(server)
    _exact(server, config_path, kind)  # short requests: the other half
    _health(server)


def _answer_kind(s: socket.socket) -> int:
  """The kind of the first frame after the server's greeting."""
  s.settimeout(60)
  kind, size = framing.parse_header(s.recv(framing.HEADER_SIZE, socket.MSG_WAITALL))
  assert kind == framing.HELLO
  s.recv(size, socket.MSG_WAITALL)
  return framing.parse_header(s.recv(framing.HEADER_SIZE, socket.MSG_WAITALL))[0]


def test_unread_bulk_requests_on_every_slot(fresh_server, config_path):
  server = fresh_server
  with _unread_bulk_requests(server, 32) as socks:
    kinds = [_answer_kind(s) for s in socks]  # every request answered: slots held
    _health(server)
    _exact(server, config_path)
    _exact(server, config_path, "grpc")
  # Endless streams got at most half the slots (more only by replacing one
  # that stalled); the rest were refused at once.
  assert kinds.count(framing.STATUS) >= 32 - 2 * LONG_SLOTS
  assert set(kinds) == {framing.STATUS, framing.BATCH}


def test_idle_bulk_connections_past_the_cap(logged, config_path):
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard < 512:
    pytest.skip(f"the open-files limit ({hard}) is too low for this test")
  resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1024)), hard))
  server = logged
  socks = [_bulk_socket(server) for _ in range(150)]
  try:
    _exact(server, config_path)  # bulk: the longest-idle sockets made room
    _health(server)
  finally:
    for s in socks:
      s.close()
  wait_for_log(server, "closing the longest idle one")


def test_idle_connections_are_closed(config_path):
  with Server(config_path, ServerOptions(port=0, workers=1, idle_timeout_s=1)) as server:
    # A peer that never greets is closed at the handshake deadline
    # (HANDSHAKE_TIMEOUT_S, 10 s): the idle one must go before it, by the
    # server's own clock, however slow the machine.
    silent = _bulk_socket(server, greet=False)
    assert silent.recv(len(framing.MAGIC), socket.MSG_WAITALL) == framing.MAGIC
    s = _bulk_socket(server)
    s.settimeout(60)
    hello = s.recv(65536)  # the server's greeting, then nothing until it hangs up
    assert hello[:1] == bytes([framing.HELLO])
    assert s.recv(1) == b""
    assert not select.select([silent], [], [], 0)[0], "closed at the handshake deadline"
    s.close()
    silent.close()
    _exact(server, config_path)  # a client reconnects without noticing


def test_a_stalled_request_is_cancelled_after_the_write_timeout(logged):
  server = logged
  with _unread_grpc_streams(server, 1, small_window=True) as (call,):
    # Its window fills first (64 KiB), however long a loaded machine takes.
    wait_for_log(server, "its client has not read for 2s (--write-timeout-s)", 180)
    with pytest.raises(grpc.RpcError) as info:
      for _ in call:
        pass
    assert info.value.code() == grpc.StatusCode.CANCELLED
