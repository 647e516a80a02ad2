"""A raw HTTP/2 peer for hostile-client tests: what no gRPC client library
sends on purpose (headers without their message, half a message, idle
connections), built with the `h2` protocol library over a plain socket."""

from __future__ import annotations

import socket
import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions


class H2Peer:
  """One HTTP/2 connection to a gRPC server, driven by hand."""

  def __init__(self, host: str, port: int, *, timeout_s: float = 10.0):
    self.sock = socket.create_connection((host, port), timeout=timeout_s)
    self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    self.conn.initiate_connection()
    self.sock.sendall(self.conn.data_to_send())
    self.authority = f"{host}:{port}"
    self.events: list[h2.events.Event] = []
    self._unsent: dict[int, bytes] = {}

  def open_call(self, method: str, *, token: str | None = None,
                declared_bytes: int | None = None, send_bytes: int = 0) -> int:
    """Starts a call to `method` ("/pkg.Service/Method"): headers, then,
    if `declared_bytes` is given, a gRPC message prefix declaring that many
    bytes followed by `send_bytes` of them (never the whole message)."""
    stream_id = self.conn.get_next_available_stream_id()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", method),
               (":authority", self.authority), ("content-type", "application/grpc"),
               ("te", "trailers")]
    if token is not None:
      headers.append(("authorization", f"Bearer {token}"))
    self.conn.send_headers(stream_id, headers)
    if declared_bytes is not None:
      self._unsent[stream_id] = struct.pack(">BI", 0, declared_bytes) + b"\0" * send_bytes
      self._pump()
    self.sock.sendall(self.conn.data_to_send())
    return stream_id

  def _pump(self) -> None:
    """Sends what the flow-control windows allow of each call's body."""
    for stream_id, body in list(self._unsent.items()):
      try:
        while body:
          n = min(self.conn.local_flow_control_window(stream_id),
                  self.conn.max_outbound_frame_size, len(body))
          if n <= 0:
            break
          self.conn.send_data(stream_id, body[:n])
          body = body[n:]
      except h2.exceptions.StreamClosedError:
        body = b""
      if body:
        self._unsent[stream_id] = body
      else:
        del self._unsent[stream_id]

  def read(self, timeout_s: float = 0.5) -> list[h2.events.Event]:
    """Events that arrive within `timeout_s`; [] on timeout. Acknowledges
    settings and pings as any client does."""
    self.sock.settimeout(timeout_s)
    try:
      data = self.sock.recv(1 << 16)
    except (socket.timeout, BlockingIOError):
      return []
    if not data:
      raise ConnectionResetError("the server closed the connection")
    events = self.conn.receive_data(data)
    self.events += events
    self._pump()
    out = self.conn.data_to_send()
    if out:
      self.sock.settimeout(10.0)
      self.sock.sendall(out)
    return events

  def statuses(self) -> dict[int, str]:
    """grpc-status of each stream that has ended, by stream id."""
    out = {}
    for e in self.events:
      if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
        for k, v in e.headers:
          if k in (b"grpc-status", "grpc-status"):
            out[e.stream_id] = v.decode() if isinstance(v, bytes) else v
      elif isinstance(e, h2.events.StreamReset):
        out.setdefault(e.stream_id, f"RST {e.error_code}")
    return out

  def close(self) -> None:
    self.sock.close()
