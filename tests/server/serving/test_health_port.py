"""The health port (server/serving/health_port.py): probes answer within
100 ms at p99 whatever the gRPC port carries (its connection cap full of
idle connections, a header-only flood, a Watch flood), and no peer address
can take the health port's own connections.

On 791bbd7 there was no health port: probes went to the gRPC port, where
(with --max-grpc-connections 40) 80 idle connections made every probe
UNAVAILABLE, 144 header-only Check calls held a probe near 1 s, and 130
Watch streams kept the cap full past the idle timeout. Attackers connect from
127.0.0.2, the probes from 127.0.0.1: two peer addresses on one loopback.

The health port is a thread of the supervisor: the tests that time probes
under attack run it in an `elevator serve` process of its own (LocalServer),
so that the attackers, which run in this process, cannot hold its
interpreter; so does the one that signals the supervisor. The others run
an in-process Server (~0.4 s to start, not ~5 s), whose supervisor, health
port included, is this process: its log is read from `logging`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.server import Server, ServerOptions
from grain_elevator.server.serving import health as health_lib
from grain_elevator.server.serving import health_port as hp
from grain_elevator.server.serving.grpc_service import REQUEST_ARRIVAL_TIMEOUT_S
from grain_elevator.tools.testing.h2peer import H2Peer
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import SCRIPTS, worker_pids

pytestmark = pytest.mark.slow  # floods of probes and watches

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
ATTACKER = "127.0.0.2"
PROBES = 50
P99_S = 0.1  # the bound: the kubelet's default probe timeout is 1 s


def _bound(target: str) -> float:
  """What an attacked probe's p99 must stay under: P99_S, or on a machine
  too loaded to meet it even unattacked, three times the unattacked p99
  measured just before (the old code's probes waited ~1 s or were refused,
  far past either)."""
  return max(P99_S, 3 * _p99_of_probes(target, 20))
SERVING = health_pb2.HealthCheckResponse.SERVING


def _check(target: str, timeout_s: float = 5.0, service: str = "") -> int:
  """A probe as the kubelet makes one: a fresh connection, one Check."""
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status



def _admitted(target: str) -> bool:
  """A probe on a fresh connection answered SERVING (False: refused)."""
  try:
    return _check(target) == SERVING
  except grpc.RpcError:
    return False


def _p99_of_probes(target: str, n: int = PROBES) -> float:
  """The p99 latency of `n` probes made by another process (tests/scripts/probe.py),
  each of which must answer SERVING; printed with p50 and max
  (BENCHMARKS.md quotes `pytest -s`)."""
  out = subprocess.run([sys.executable, str(SCRIPTS / "probe.py"), "--target", target,
                        "--probes", str(n)], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  took = json.loads(out.stdout)
  assert None not in took, f"{took.count(None)} of {n} probes did not answer SERVING"
  p50, p99 = np.percentile(took, [50, 99]) * 1e3
  print(f"\n{n} probes at {target}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"max {max(took) * 1e3:.1f} ms", end=" ")
  return p99 / 1e3


def _open_from(server, peer: str, count: int, port: int | None = None) -> list[H2Peer]:
  """`count` HTTP/2 connections from address `peer` (fewer if refused)."""
  out = []
  for _ in range(count):
    try:
      out.append(H2Peer(server.host, port or server.port, source=peer))
    except OSError:
      break
  return out


def _established(pid: int, port: int, peer: str | None = None, host: str | None = None
                 ) -> int:
  """Connections process `pid` holds on local `port` (from `peer` only; on
  local address `host` only: this process holds the attackers' ends too
  when the server runs in it)."""
  return sum(1 for c in psutil.Process(pid).net_connections("tcp")
             if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
             and (host is None or c.laddr.ip == host)
             and (peer is None or (c.raddr and c.raddr.ip == peer)))


def _health_target(server: Server | LocalServer) -> str:
  return f"{server.host}:{server.health_port}"


def _wait_for(condition, timeout_s: float, why: str) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"after {timeout_s:g}s: {why}")
    time.sleep(0.05)


@contextlib.contextmanager
def _kept(peers: list[H2Peer], method: str | None = None, **call) -> Iterator[None]:
  """Keeps `peers` read (settings, pings) from a thread, and with `method`
  keeps each connection's streams full of calls to it, reopening those the
  server ends (every 0.1 s, as tools/bench/attack.py's attackers do)."""
  stop = threading.Event()

  def keep() -> None:
    while not stop.wait(0.1):
      for p in peers:
        if p.closed:
          continue
        try:
          p.read(0)
          if method is not None:
            for _ in range(max(0, p.room())):
              p.open_call(method, **call)
        except ConnectionResetError:
          pass
  thread = threading.Thread(target=keep, daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()
    for p in peers:
      p.close()


@pytest.fixture(scope="module")
def capped(config_path: str) -> Iterator[LocalServer]:
  """One worker, --max-grpc-connections 40: the two probe-timing tests that
  load the gRPC port share it (each leaves it holding no connection)."""
  with LocalServer(config_path, workers=1,
                   extra_args=("--max-grpc-connections", "40")) as server:
    yield server


def test_probes_answer_while_the_grpc_port_is_full_of_idle_connections(capped):
  server = capped
  (worker,) = worker_pids(server)
  bound = _bound(server.health_target)
  idle = _open_from(server, ATTACKER, 80)
  with _kept(idle):
    _wait_for(lambda: _established(worker, server.port) >= 40, 10, "the cap never filled")
    # The gRPC port refuses newcomers, probes included (what 791bbd7's probes met).
    with pytest.raises(grpc.RpcError) as info:
      _check(server.target, timeout_s=2)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                 grpc.StatusCode.DEADLINE_EXCEEDED)
    p99 = _p99_of_probes(server.health_target)
    assert _established(worker, server.port) >= 40  # still full throughout
  assert p99 < bound, f"p99 {p99 * 1e3:.0f} ms, bound {bound * 1e3:.0f} ms"
  # The worker lets go of the connections the attacker closed.
  _wait_for(lambda: _established(worker, server.port) == 0, 30,
            "the worker kept closed connections")


def test_probes_answer_under_a_header_only_flood(capped):
  # 8 connections x 32 header-only Check calls on the gRPC port, reopened as
  # the server ends them. On 791bbd7 each held a health thread for the
  # arrival deadline, and a probe there waited ~1 s. (8 connections: the
  # shared server's cap of 40 does not bind.)
  server = capped
  bound = _bound(server.health_target)
  flood = _open_from(server, ATTACKER, 8)
  with _kept(flood, CHECK):
    _wait_for(lambda: sum(len(p.statuses()) for p in flood) >= 200, 10,
              "the flood's calls were not answered")
    p99 = _p99_of_probes(server.health_target)
    ended = [s for p in flood for s in p.statuses().values()]
  # On the gRPC port one address keeps at most MAX_WAITING_PER_PEER health
  # calls waiting for their message; the others are refused at once.
  assert ended.count("8") > 0.9 * len(ended), f"{len(ended)} calls: {set(ended)}"
  assert _check(server.target) == SERVING  # the gRPC port's own
  assert p99 < bound, f"p99 {p99 * 1e3:.0f} ms, bound {bound * 1e3:.0f} ms"


def test_probes_answer_under_a_watch_flood_and_watches_end(config_path):
  # 130 connections from one address, each holding one health Watch sent
  # without a token, against a cap of 128. On 791bbd7 they held the cap past
  # the idle timeout, for as long as the attacker liked.
  idle_timeout_s = 2
  with LocalServer(config_path, workers=1, extra_args=(
      "--max-grpc-connections", "128", "--idle-timeout-s", str(idle_timeout_s))) as server:
    (worker,) = worker_pids(server)
    bound = _bound(server.health_target)
    flood = _open_from(server, ATTACKER, 130)
    watches = [p.open_call(WATCH, declared_bytes=0) for p in flood]
    for p in flood:
      with contextlib.suppress(ConnectionResetError):  # past the cap: closed
        p.read(0)  # sends each Watch's request message
    with _kept(flood):
      p99 = _p99_of_probes(server.health_target)
      # Past MAX_WATCHES_PER_PEER they are refused; those open end after the
      # idle timeout (status OK), and their connections are closed idle.
      _wait_for(lambda: all(w in p.statuses() or p.closed for p, w in zip(flood, watches)),
                4 * idle_timeout_s + 10, "some Watch streams never ended")
      ended = [p.statuses().get(w) for p, w in zip(flood, watches)]
      assert ended.count("8") >= min(len(flood), 128) - health_lib.MAX_WATCHES_PER_PEER
      assert ended.count("0") <= health_lib.MAX_WATCHES_PER_PEER
      _wait_for(lambda: _established(worker, server.port, ATTACKER) == 0,
                4 * idle_timeout_s + 10, "the flood's connections were not closed")
    # A newcomer gets in. gRPC counts a connection against the cap until its
    # transport is torn down, which can lag the socket's close: wait for the
    # first probe it admits rather than take the first one made.
    _wait_for(lambda: _admitted(server.target), 10,
              "a newcomer was refused after the flood's connections were closed")
  assert p99 < bound, f"p99 {p99 * 1e3:.0f} ms, bound {bound * 1e3:.0f} ms"


def test_a_watch_with_the_token_outlasts_the_idle_timeout(config_path, tmp_path):
  token = tmp_path / "token"
  token.write_text("s3cret\n")
  with Server(config_path, ServerOptions(port=0, workers=1, idle_timeout_s=1,
                                         auth_token_file=str(token))) as server:
    (anonymous, trusted) = _open_from(server, ATTACKER, 2)
    plain = anonymous.open_call(WATCH, declared_bytes=0)
    keeps = trusted.open_call(WATCH, declared_bytes=0, token="s3cret")
    with _kept([anonymous, trusted]):
      _wait_for(lambda: plain in anonymous.statuses(), 10, "the Watch without the token "
                "was not refused")
      time.sleep(2)  # twice the idle timeout: the one with the token is still open
      assert keeps not in trusted.statuses() and not trusted.closed
    # With a token, health on the gRPC port needs it too (front_door.py).
    assert anonymous.statuses()[plain] == "16"


def test_one_address_cannot_take_the_health_ports_connections(config_path, grain_elevator_logs):
  with Server(config_path, ServerOptions(port=0, workers=1)) as server:
    def held(peer: str | None = None) -> int:  # the health port's ends, in this process
      return _established(os.getpid(), server.health_port, peer, host=server.host)

    n = hp.HEALTH_MAX_CONNECTIONS + 20
    attackers = _open_from(server, ATTACKER, n, port=server.health_port)
    with _kept(attackers, CHECK):  # each holding header-only calls too
      assert len(attackers) == n  # none refused: the oldest of the address made room
      _wait_for(lambda: held(ATTACKER) <= hp.HEALTH_MAX_CONNECTIONS_PER_PEER, 10,
                "the address kept more")
      assert _check(_health_target(server)) == SERVING
    # Many addresses, each within its limit, past the total: a newcomer gets in.
    many = [p for i in range(2, 2 + hp.HEALTH_MAX_CONNECTIONS // 4 + 4)
            for p in _open_from(server, f"127.0.0.{i}", 4, port=server.health_port)]
    with _kept(many):
      _wait_for(lambda: held() <= hp.HEALTH_MAX_CONNECTIONS + 1, 10, "the total was passed")
      assert _check(_health_target(server)) == SERVING
    _wait_for(lambda: "for its newcomer" in grain_elevator_logs.text, 10, "no log line")


def test_the_health_port_bounds_what_a_connection_holds(config_path, grain_elevator_logs):
  with Server(config_path, ServerOptions(port=0, workers=1)) as server:
    port = server.health_port
    (peer,) = _open_from(server, ATTACKER, 1, port=port)
    with contextlib.closing(peer.sock):
      calls = [peer.open_call(CHECK),  # headers only: cut at the arrival deadline
               peer.open_call(CHECK, declared_bytes=hp.HEALTH_MAX_REQUEST_BYTES + 1),
               peer.open_call("/grain_elevator.v1.Elevator/Describe", declared_bytes=0)]
      _wait_for(lambda: (peer.read(0.05), set(calls) <= set(peer.statuses()))[1],
                10 * REQUEST_ARRIVAL_TIMEOUT_S, "calls never ended")
      assert [peer.statuses()[c] for c in calls] == ["RST 8", "8", "12"]
    # A connection that sends nothing is closed; so is one that floods, once
    # its address has cost the loop its budget (a ping costs it >= 1 us).
    with socket.create_connection((server.host, port)) as silent:
      silent.settimeout(4 * hp.HEALTH_FIRST_REQUEST_TIMEOUT_S)  # else socket.timeout
      while silent.recv(1 << 16):  # SETTINGS, then GOAWAY, then EOF
        pass
    with socket.create_connection((server.host, port), timeout=10,
                                  source_address=(ATTACKER, 0)) as flood:
      ping = bytes.fromhex("000008060000000000") + bytes(8)
      flood.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
      with pytest.raises(OSError):
        for _ in range(int(hp.HEALTH_PEER_CPU_BURST_S / 1e-6) // 16):
          flood.sendall(ping * 16)
          if not flood.recv(1 << 16):  # pongs until the server closes it
            raise ConnectionResetError("closed")
    _wait_for(lambda: "cost the loop more than" in grain_elevator_logs.text, 10,
              "no log line")
    assert _check(_health_target(server)) == SERVING  # 127.0.0.1: its budget is its own
    assert "Traceback" not in grain_elevator_logs.text


def test_the_health_port_says_what_the_workers_say(config_path):
  # A worker that stops answering (SIGSTOP) makes the server NOT_SERVING on
  # the health port, and SERVING again once it answers.
  import signal  # pylint: disable=g-import-not-at-top
  with Server(config_path, ServerOptions(port=0, workers=2)) as server:
    stub_target = _health_target(server)
    assert _check(stub_target) == SERVING
    with grpc.insecure_channel(stub_target) as ch:
      listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5)
    assert set(listed.statuses) == {"", "grain_elevator.v1.Elevator"}
    with pytest.raises(grpc.RpcError) as info:
      _check(stub_target, service="nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    worker = server.worker_pids()[0]
    psutil.Process(worker).send_signal(signal.SIGSTOP)
    try:
      _wait_for(lambda: _check(stub_target) == health_lib.NOT_SERVING,
                4 * health_lib.PROBE_TIMEOUT_S, "a stopped worker went unnoticed")
    finally:
      psutil.Process(worker).send_signal(signal.SIGCONT)
    _wait_for(lambda: _check(stub_target) == SERVING, 4 * health_lib.PROBE_TIMEOUT_S,
              "the worker answered again but health did not say so")


def test_a_stopping_server_says_not_serving(config_path):
  # A stream nobody reads keeps the server in its grace period after SIGTERM:
  # the health port answers NOT_SERVING meanwhile, so that the pod leaves
  # the rotation while its streams finish.
  import signal  # pylint: disable=g-import-not-at-top
  from grain_elevator.proto import elevator_pb2 as pb  # pylint: disable=g-import-not-at-top
  from grain_elevator.proto import elevator_pb2_grpc as pb_grpc  # pylint: disable=g-import-not-at-top
  endless = pb.BatchRequest(dataset="forever", global_batch_size=256, shard_count=1,
                            num_steps=1_000_000)
  with LocalServer(config_path, workers=1, extra_args=("--grace-s", "30")) as server, \
       grpc.insecure_channel(server.target) as channel:
    call = pb_grpc.ElevatorStub(channel).GetBatches(endless, timeout=120)
    try:
      next(call)  # it runs
      assert _check(server.health_target) == SERVING
      server.proc.send_signal(signal.SIGTERM)
      _wait_for(lambda: _check(server.health_target) == health_lib.NOT_SERVING, 10,
                "health said SERVING while the server stopped")
    finally:
      call.cancel()
    assert server.proc.wait(60) == 0


def test_a_watch_on_the_health_port_hears_each_change_and_ends():
  """In-process: the health port's Watch sends the status at once and on
  each change, SERVICE_UNKNOWN for a service it does not serve, and ends
  (status OK) when its time is up."""
  status = [SERVING]
  port = hp.HealthPort(lambda: status[0], ("",), watch_s=3.0)
  target = f"127.0.0.1:{port.start('127.0.0.1', 0)}"
  try:
    with grpc.insecure_channel(target) as ch:
      stub = health_pb2_grpc.HealthStub(ch)
      unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
      assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
      unknown.cancel()
      watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
      assert next(watch).status == SERVING
      status[0] = health_lib.NOT_SERVING
      assert next(watch).status == health_lib.NOT_SERVING
      assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
          health_lib.NOT_SERVING)
      status[0] = SERVING
      assert next(watch).status == SERVING
      assert list(watch) == []  # ended by the server after watch_s
      assert watch.code() == grpc.StatusCode.OK
  finally:
    port.stop()
