"""The bulk transport's server: GetBatches over plain TCP, beside gRPC.

gRPC costs the receiving trainer 0.7-0.85 CPU-seconds per GB on this class
of machine; a plain socket costs ~0.15 (DESIGN.md §3). This serves the same
requests with the same Batch bytes and status codes over a socket, one
request at a time per connection, a thread per connection. Workers share the
port with SO_REUSEPORT, like the gRPC port.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time

import grpc

from grain_elevator.proto import bulk
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.server.errors import ElevatorError
from grain_elevator.server.servicer import ElevatorServicer

log = logging.getLogger("grain_elevator.server")
_MAX_CONNECTIONS = 1024
_HANDSHAKE_TIMEOUT_S = 10.0
_MAX_REQUEST_BYTES = 1 << 20


def _status(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
  payload = pb.BulkStatus(code=code.value[0], message=message).SerializeToString()
  bulk.send_frame(sock, bulk.STATUS, [payload])


class _Connection:
  def __init__(self, sock: socket.socket):
    self.sock = sock
    self.busy = False


class BulkServer:
  """Listens on `host:port` and serves `servicer.batches` to each connection."""

  def __init__(self, servicer: ElevatorServicer, host: str, port: int, *,
               auth_token: str | None = None, max_concurrent_requests: int = 16):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._listener = socket.socket(family, socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    self._listener.bind((host, port))
    self._listener.listen(128)
    self.port: int = self._listener.getsockname()[1]
    self._servicer = servicer
    self._token = auth_token
    self._max_requests = max_concurrent_requests
    self._lock = threading.Condition()
    self._conns: set[_Connection] = set()
    self._requests = 0
    self._stopping = False
    self._thread = threading.Thread(target=self._accept_loop, name="elevator-bulk-accept",
                                    daemon=True)

  def start(self) -> None:
    self._thread.start()

  def _accept_loop(self) -> None:
    while True:
      try:
        sock, _ = self._listener.accept()
      except OSError:
        return  # listener closed by stop()
      conn = _Connection(sock)
      with self._lock:
        if self._stopping or len(self._conns) >= _MAX_CONNECTIONS:
          sock.close()
          continue
        self._conns.add(conn)
      threading.Thread(target=self._serve, args=(conn,), name="elevator-bulk",
                       daemon=True).start()

  def _serve(self, conn: _Connection) -> None:
    sock = conn.sock
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      sock.settimeout(_HANDSHAKE_TIMEOUT_S)
      bulk.exchange_magic(sock)
      bulk.send_frame(sock, bulk.HELLO, [self._servicer.server_info.SerializeToString()])
      sock.settimeout(None)  # idle connections wait for their next request
      while True:
        _, payload = bulk.recv_frame(sock, (bulk.REQUEST,))
        if len(payload) > _MAX_REQUEST_BYTES:
          raise bulk.ProtocolError("request frame too large")
        request = pb.BulkRequest.FromString(payload.tobytes())
        if not self._begin(conn, sock, request):
          continue
        try:
          for parts in self._servicer.batches(request.request):
            bulk.send_frame(sock, bulk.BATCH, parts)
        except ElevatorError as e:
          _status(sock, e.code, str(e))
        finally:
          self._end(conn)
    except (OSError, bulk.ProtocolError, ValueError) as e:
      # The client went away or cancelled (it closes the connection), or does
      # not speak the protocol: either way this connection is done.
      if isinstance(e, (bulk.ProtocolError, ValueError)):
        log.warning("bulk connection dropped: %s", e)
    finally:
      with self._lock:
        self._conns.discard(conn)
        self._lock.notify_all()
      sock.close()

  def _begin(self, conn: _Connection, sock: socket.socket, request: pb.BulkRequest) -> bool:
    """Admits a request, or answers it with the status gRPC would give."""
    if self._token is not None and not hmac.compare_digest(
        request.auth_token.encode(), self._token.encode()):
      _status(sock, grpc.StatusCode.UNAUTHENTICATED,
              "missing or wrong bearer token" if request.auth_token
              else "this server requires a bearer token (auth_token)")
      return False
    with self._lock:
      if self._stopping:
        refused = (grpc.StatusCode.UNAVAILABLE, "server is shutting down")
      elif self._requests >= self._max_requests:
        refused = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"worker is serving its maximum of {self._max_requests} "
                   "concurrent requests")
      else:
        refused = None
        self._requests += 1
        conn.busy = True
    if refused:
      _status(sock, *refused)
      return False
    return True

  def _end(self, conn: _Connection) -> None:
    with self._lock:
      self._requests -= 1
      conn.busy = False
      self._lock.notify_all()

  def stop(self, grace_s: float) -> None:
    """Stops accepting, lets requests in flight finish within `grace_s`, then
    closes every connection."""
    with self._lock:
      self._stopping = True
      idle = [c for c in self._conns if not c.busy]
    self._listener.close()
    for conn in idle:
      _shutdown(conn.sock)
    deadline = time.monotonic() + grace_s
    with self._lock:
      while self._requests and time.monotonic() < deadline:
        self._lock.wait(max(0.0, deadline - time.monotonic()))
      remaining = list(self._conns)
    for conn in remaining:
      _shutdown(conn.sock)


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
