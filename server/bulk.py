"""The bulk transport's server: GetBatches over plain TCP, beside gRPC.

gRPC costs the receiving trainer 0.7-0.85 CPU-seconds per GB on this class
of machine; a plain socket costs ~0.15 (docs/design.md). This serves the
same requests with the same Batch bytes and status codes over a socket, one
request at a time per connection, a thread per connection. It is a thin
adapter: a request frame is bounded before it is read (proto/framing.py),
then authentication, admission, validation and status mapping are the
request path's (server/request_path.py). Workers share the port with
SO_REUSEPORT, like the gRPC port.
"""

from __future__ import annotations

import logging
import socket
import threading

from google.protobuf import message as protobuf_message

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import framing
from grain_elevator.server import sockets
from grain_elevator.server.request_path import MAX_REQUEST_BYTES, RequestPath

log = logging.getLogger("grain_elevator.server")
_MAX_CONNECTIONS = 1024
_HANDSHAKE_TIMEOUT_S = 10.0


def _send_status(sock: socket.socket, error: errors.ElevatorError) -> None:
  code, message, type_name = errors.status_of(error)
  payload = pb.BulkStatus(code=code.value[0], message=message,
                          error_type=type_name).SerializeToString()
  framing.send_frame(sock, framing.STATUS, [payload])


class _Connection:
  def __init__(self, sock: socket.socket):
    self.sock = sock
    self.busy = False


class BulkServer:
  """Listens on `host:port` and serves the request path to each connection."""

  def __init__(self, path: RequestPath, host: str, port: int):
    self._listener = sockets.bind_shared(host, port)
    self._listener.listen(128)
    self.port: int = self._listener.getsockname()[1]
    self._path = path
    self._lock = threading.Lock()
    self._conns: set[_Connection] = set()
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
      framing.exchange_magic(sock)
      framing.send_frame(sock, framing.HELLO, [self._path.server_info.SerializeToString()])
      sock.settimeout(None)  # idle connections wait for their next request
      while True:
        _, payload = framing.recv_frame(sock, (framing.REQUEST,), MAX_REQUEST_BYTES)
        try:
          request = pb.BulkRequest.FromString(payload.tobytes())
        except protobuf_message.DecodeError as e:
          raise framing.ProtocolError(f"request frame is not a BulkRequest: {e}") from e
        try:
          self._path.authenticate(request.auth_token or None)
          with self._path.admission():
            conn.busy = True
            try:
              for parts in self._path.encoded_steps(request.request):
                framing.send_frame(sock, framing.BATCH, parts)
            finally:
              conn.busy = False
        except errors.ElevatorError as e:
          _send_status(sock, e)
    except (OSError, framing.ProtocolError) as e:
      # The client went away or cancelled (it closes the connection), or does
      # not speak the protocol: either way this connection is done.
      if isinstance(e, framing.ProtocolError):
        log.warning("bulk connection dropped: %s", e)
    finally:
      with self._lock:
        self._conns.discard(conn)
      sock.close()

  def stop(self, grace_s: float) -> None:
    """Stops accepting, lets requests in flight finish within `grace_s`, then
    closes every connection. (The request path refuses new requests already.)"""
    with self._lock:
      self._stopping = True
      idle = [c for c in self._conns if not c.busy]
    self._listener.close()
    for conn in idle:
      _shutdown(conn.sock)
    self._path.admission.wait_idle(grace_s)
    with self._lock:
      remaining = list(self._conns)
    for conn in remaining:
      _shutdown(conn.sock)


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
