"""The bulk transport: same batches as gRPC and the oracle, same errors,
held batches never overwritten, and it stays out of the way when it can't
be used.

Tests that only read from a server share the session's in-process ones
(`serve`); those that read a server's log (an in-process server's workers
log where no test can read) or signal its supervisor share one `elevator
serve` (`process_server`)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Iterator

import grpc
import numpy as np
import pytest

from grain_elevator.client import (RemoteDataset, RetryPolicy, ServiceUnavailableError,
                                   TransportOptions)
from grain_elevator.client.transport.bulk_connection import BulkConnection
from grain_elevator.client.transport.connection import CancelToken, TransportError
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.limits import MAX_REQUEST_BYTES
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import (assert_streams_equal, assert_trees_equal, busy_cpu_rate, closed_by_peer,
                     cpu_rate_over, oracle_batch, wait_for, wait_for_log)


def _connect(host: str, port: int) -> BulkConnection:
  return BulkConnection(f"{host}:{port}", host, port, connect_timeout_s=10)


def _stream(conn: BulkConnection, request: pb.BatchRequest, timeout_s: float = 30):
  return conn.stream(request, timeout_s=timeout_s, token=CancelToken(),
                     max_frame_bytes=1 << 26)


def _request(dataset: str = "plain", g: int = 16, start: int = 0, steps: int = 3,
             **kw) -> pb.BatchRequest:
  return pb.BatchRequest(dataset=dataset, global_batch_size=g, shard_count=1,
                         start_step=start, num_steps=steps, **kw)


@pytest.fixture(scope="module")
def shared(serve) -> Server:
  """The session's in-process 2-worker server, for the tests that only read."""
  return serve(workers=2)


def test_server_offers_it_and_the_client_uses_it(shared):
  server = shared
  assert server.bulk_port
  with RemoteDataset(server.target, "plain", 16) as ds:
    it = iter(ds)
    next(it)
    assert it._backend.uses_bulk  # pylint: disable=protected-access


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("transport", ["grpc", "bulk"])
def test_transports_and_compression_match_the_oracle(shared, config_path, transport,
                                                     compression):
  server = shared
  # 2,000, 1,000 and 1,000 records: whole global batches only.
  for dataset, g, h, n, steps in (("aug2", 48, 1, 3, 41), ("seed3fast", 64, 0, 2, 15),
                                  ("raw", 32, 0, 1, 31)):
    with RemoteDataset(server.target, dataset, g, shard_index=h, shard_count=n,
                       transport=TransportOptions(kind=transport,
                                                  compression=compression)) as remote:
      with RemoteDataset.embedded(config_path, dataset, g, shard_index=h,
                                  shard_count=n) as local:
        assert assert_streams_equal(remote, local) == steps


def test_held_batches_are_never_overwritten(shared, oracle):
  """Every batch gets its own receive buffer: a trainer may keep batches
  (a replay buffer, a device queue) while the stream goes on."""
  server = shared
  g = 64
  with RemoteDataset(server.target, "forever", g, transport=TransportOptions(kind="bulk"),
                     prefetch=4) as ds:
    it = iter(ds)
    held = [next(it) for _ in range(20)]
    snapshots = [{k: v.copy() for k, v in b.items()} for b in held]
    for _ in range(60):
      next(it)
  for k, (b, snap) in enumerate(zip(held, snapshots)):
    assert_trees_equal(b, snap, f"held step {k}")
    assert_trees_equal(b, oracle_batch(oracle, "forever", k, g), f"held step {k}")


@pytest.mark.parametrize("request_kw, code, message", [
    ({"dataset": "nope"}, grpc.StatusCode.NOT_FOUND, "nope"),
    ({"g": 0}, grpc.StatusCode.INVALID_ARGUMENT, "global_batch_size"),
    ({"start": 10**9}, grpc.StatusCode.OUT_OF_RANGE, "step"),
    ({"config_fingerprint": "0000"}, grpc.StatusCode.FAILED_PRECONDITION, "fingerprint"),
])
def test_bad_requests_get_grpc_statuses_and_the_connection_lives_on(
    shared, oracle, request_kw, code, message):
  server = shared
  conn = _connect(server.host, server.bulk_port)
  try:
    with pytest.raises(TransportError) as info:
      list(_stream(conn, _request(**request_kw), 30))
    assert info.value.code == code
    assert message in info.value.details
    assert not conn.broken
    (step, leaves, _, _), = list(_stream(conn, _request(start=5, steps=1), 30))
    assert step == 5
    assert leaves[1].tobytes() == oracle_batch(oracle, "plain", 5, 16)["image"].tobytes()
  finally:
    conn.close()


def test_garbage_is_dropped_and_others_are_still_served(shared):
  server = shared
  with socket.create_connection((server.host, server.bulk_port), timeout=10) as s:
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    try:
      while s.recv(65536):  # its greeting, then it hangs up (not a timeout)
        pass
    except ConnectionResetError:
      pass
  conn = _connect(server.host, server.bulk_port)
  try:
    assert len(list(_stream(conn, _request(), 30))) == 3
  finally:
    conn.close()


def test_a_non_elevator_port_is_a_clear_unavailable(tmp_path):
  with socket.create_server(("127.0.0.1", 0)) as listener:
    port = listener.getsockname()[1]
    told = threading.Event()

    def answer():
      c, _ = listener.accept()
      c.sendall(b"SSH-2.0-OpenSSH\r\n")
      told.wait(60)  # open until the client has its answer: no reset races it
      c.close()
    threading.Thread(target=answer, daemon=True).start()
    try:
      with pytest.raises(TransportError, match="not the bulk protocol") as info:
        _connect("127.0.0.1", port)
    finally:
      told.set()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_no_bulk_server_means_grpc(serve, oracle):
  srv = serve(workers=1, bulk=False)
  assert srv.bulk_port is None
  with RemoteDataset(srv.target, "seed3", 50) as ds:
    it = iter(ds)
    assert_trees_equal(next(it), oracle_batch(oracle, "seed3", 0, 50))
    assert not it._backend.uses_bulk  # pylint: disable=protected-access
  with pytest.raises(ServiceUnavailableError, match="no replica .* offers a reachable bulk"):
    next(iter(RemoteDataset(srv.target, "seed3", 50,
                            transport=TransportOptions(kind="bulk"))))


@pytest.mark.parametrize("bulk_args", [("--bulk", "on"), ("--bulk-port", "50052")])
def test_bulk_with_tls_is_refused(config_path, tmp_path, bulk_args, elevator):
  for name in ("cert.pem", "key.pem"):
    (tmp_path / name).write_text("x")
  code, _, err = elevator("serve", "--config", str(config_path), "--port", "0", *bulk_args,
                          "--tls-cert", str(tmp_path / "cert.pem"),
                          "--tls-key", str(tmp_path / "key.pem"))
  assert code == 2
  assert "the bulk transport (--bulk, --bulk-port) serves plaintext" in err


@pytest.mark.slow  # measures worker CPU for seconds
def test_a_cancelled_bulk_stream_stops_the_server_computing(config_path):
  import psutil
  with Server(config_path, ServerOptions(port=0, workers=1, metrics_port=0)) as srv:
    (pid,) = srv.worker_pids()
    worker = psutil.Process(pid)
    conn = _connect(srv.host, srv.bulk_port)
    stream = _stream(conn, _request("forever", 512, steps=1_000_000), 60)

    def read_all():
      try:
        for _ in stream:
          pass
      except TransportError:
        pass

    threading.Thread(target=read_all, daemon=True).start()
    busy = busy_cpu_rate(worker)
    conn.cancel()
    # The server ended the request (its metrics say so), whenever a loaded
    # machine lets it notice; then what it still computes is measured.
    wait_for(lambda: top.scrape(f"127.0.0.1:{srv.metrics_port}", timeout_s=30)[
        ("elevator_inflight_requests", ())] == 0, "the server to end the cancelled request")
    time.sleep(0.5)
    idle = cpu_rate_over(worker, 1.5)
    conn.close()
  assert idle < busy / 4, f"worker still busy after cancel: {idle:.2f} vs {busy:.2f} CPU-s/s"


@pytest.mark.slow  # stops and restarts a server
def test_a_restarted_server_on_a_new_bulk_port_is_found_again(config_path, oracle):
  """Failover re-asks a replica for its bulk port: with the default free-port
  choice, a restarted server listens somewhere else. (Stopped without a
  grace period: the stream in flight is cut at once, not after 5 s.)"""
  first = Server(config_path, ServerOptions(port=0, workers=1, grace_s=0)).start()
  try:
    with RemoteDataset(first.target, "forever", 32, prefetch=2,
                       transport=TransportOptions(kind="bulk"),
                       retry=RetryPolicy(timeout_s=60)) as ds:
      it = iter(ds)
      got = [next(it) for _ in range(5)]
      port, old_bulk = first.port, first.bulk_port
      first.stop()
      new_bulk = old_bulk
      while new_bulk == old_bulk:
        with socket.create_server(("127.0.0.1", 0)) as probe:
          new_bulk = probe.getsockname()[1]
      with Server(config_path, ServerOptions(port=port, workers=1, bulk_port=new_bulk)
                  ) as second:
        assert second.bulk_port == new_bulk
        got += [next(it) for _ in range(20)]
  finally:
    first.stop()  # a second stop does nothing; the first, if the test failed before it
  for k, batch in enumerate(got):
    assert_trees_equal(batch, oracle_batch(oracle, "forever", k, 32), f"step {k}")


def test_a_dns_target_gets_bulk_connections_to_its_addresses(shared, oracle):
  """dns:///name:port (a headless Service) resolves to each replica's address."""
  server = shared
  target = f"dns:///localhost:{server.port}"
  with RemoteDataset(target, "seed3", 50, transport=TransportOptions(kind="bulk")) as ds:
    it = iter(ds)
    assert_trees_equal(next(it), oracle_batch(oracle, "seed3", 0, 50))
    hosts = {s.conn.host for s in it._backend.data_slots()}  # pylint: disable=protected-access
  assert "127.0.0.1" in hosts


def test_a_frame_sent_in_pieces_arrives_whole():
  """Partial sends (a socket with a timeout is non-blocking underneath) resume
  mid-buffer: the frame is the parts' bytes in order, whatever their types."""
  from grain_elevator.pipelines import RowStack
  from grain_elevator.proto import framing
  rng = np.random.default_rng(3)
  rows = RowStack([rng.integers(0, 255, (300, 400), np.uint8) for _ in range(6)])
  parts = [b"head", memoryview(np.arange(1000, dtype=np.float32)).cast("B"), b"",
           *rows.buffers(), b"tail"]
  want = b"".join(bytes(p) for p in parts)
  a, b = socket.socketpair()
  a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
  a.settimeout(10)
  b.settimeout(10)
  sender = threading.Thread(target=framing.send_frame, args=(a, framing.BATCH, parts))
  sender.start()
  time.sleep(0.2)  # let the sender fill the buffer and wait
  kind, payload = framing.recv_frame(b, (framing.BATCH,), len(want))
  sender.join(10)
  a.close()
  b.close()
  assert kind == framing.BATCH and payload.tobytes() == want


def test_a_frame_over_the_limit_is_refused_before_it_is_read():
  """The length is checked against the receiver's limit before a byte of the
  payload is allocated or read: a peer promising 2**34 bytes gets nothing."""
  from grain_elevator.proto import framing
  a, b = socket.socketpair()
  with a, b:
    b.settimeout(10)
    a.sendall(framing.header(framing.REQUEST, 1 << 34) + b"x" * 100)
    with pytest.raises(framing.ProtocolError, match="request frame of 17179869184 bytes "
                                                     "is over this end's limit of 1048576"):
      framing.recv_frame(b, (framing.REQUEST,), 1 << 20)
    assert b.recv(1000) == b"x" * 100  # the payload was never read


@pytest.fixture(scope="module")
def process_server(config_path: str) -> Iterator[LocalServer]:
  """`elevator serve` for the tests that read its log, --grace-s 20: the
  last of them, at the end of this file, stops it with SIGTERM."""
  with LocalServer(config_path, workers=1, extra_args=("--grace-s", "20")) as s:
    yield s


def _greeted(server) -> socket.socket:
  """A raw connection to the bulk port, past the magic and the server's hello."""
  from grain_elevator.proto import framing
  s = socket.create_connection((server.host, server.bulk_port), timeout=10)
  framing.exchange_magic(s)
  framing.recv_frame(s, (framing.HELLO,), 1 << 20)
  return s


def _logged_since(server, start: int, text: str) -> str:
  """The server's log from `start` on, once it holds `text` (the log is read
  by another thread, a moment after the server wrote it)."""
  wait_for(lambda: text in server.stderr()[start:], f"the server to log {text!r}")
  return server.stderr()[start:]


def test_a_frame_promising_2_34_bytes_is_refused_unread(process_server):
  """Before authentication and before allocating: the server reads the
  header, refuses the length, and hangs up."""
  server = process_server
  from grain_elevator.proto import framing
  logged = len(server.stderr())
  with _greeted(server) as s:
    s.sendall(framing.header(framing.REQUEST, 1 << 34))
    try:
      s.sendall(b"\0" * (1 << 20))
    except OSError:
      pass  # already closed: as good
    assert closed_by_peer(s)
  refused = ("request frame of 17179869184 bytes is over this end's limit of "
             f"{MAX_REQUEST_BYTES}")
  assert refused in _logged_since(server, logged, refused)
  conn = _connect(server.host, server.bulk_port)  # and everyone else is still served
  try:
    assert len(list(_stream(conn, _request()))) == 3
  finally:
    conn.close()


def test_a_request_that_is_not_protobuf_is_dropped_without_a_traceback(process_server):
  server = process_server
  from grain_elevator.proto import framing
  logged = len(server.stderr())
  with _greeted(server) as s:
    framing.send_frame(s, framing.REQUEST, [b"\xff\xff\xff\xff not protobuf"])
    assert closed_by_peer(s)
  dropped = "bulk connection dropped: request frame is not a BulkRequest"
  log = _logged_since(server, logged, dropped)
  assert dropped in log
  assert "Traceback" not in log


def test_sigterm_finishes_in_flight_bulk_requests_and_refuses_new_ones(process_server):
  """The last test of `process_server`: it stops it."""
  srv = process_server
  busy = _connect(srv.host, srv.bulk_port)
  idle = _connect(srv.host, srv.bulk_port)
  stream = _stream(busy, _request(steps=60, g=8), 60)
  first = next(stream)
  srv.proc.send_signal(signal.SIGTERM)
  wait_for_log(srv, "stopping: new requests are refused")
  with pytest.raises(TransportError) as info:  # idle connections are closed
    list(_stream(idle, _request(steps=1), 10))
  assert info.value.code == grpc.StatusCode.UNAVAILABLE
  rest = list(stream)  # the in-flight request still completes
  assert first[0] == 0 and [s for s, *_ in rest] == list(range(1, 60))
  assert srv.proc.wait(60) == 0
  busy.close()
  idle.close()
