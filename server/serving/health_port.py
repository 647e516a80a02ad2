"""The health port: grpc.health.v1.Health for probes, apart from everything else.

A probe must be answered whatever the other ports carry: their connection
caps full of idle or hostile connections, their health threads held by
calls whose message never comes, Watch streams by the hundred. So probes
get a listener of their own, served by one thread of the supervisor
(server/process/supervisor.py), not by a worker: the kubelet's gRPC probe,
grpc_health_probe, `elevator health` and any gRPC client speak to it as to
any gRPC server (HTTP/2 without TLS, like the kubelet's probe), and what
they are told is the whole server's status (server/process/health_board.py),
read from memory as each request arrives: no request waits for a thread, a
worker or another request.

What a peer can cost is bounded, whatever it does. A peer is a client
address (an IPv6 one's /64: what one host holds), and its budgets outlive
its connections, so that a peer that churns connections gets no fresh ones:
  * time of the loop: each address may make the loop spend
    HEALTH_PEER_CPU_BURST_S of CPU at once, refilled over
    HEALTH_PEER_CPU_REFILL_S (a probe costs about a millisecond): what its
    connections' bytes and deadlines cost, not accepting them, which the
    connection limits and _ACCEPTS_PER_TICK bound, so that connections
    churned from a prober's own address do not spend its budget. Past it,
    the connection that overspent is closed (GOAWAY ENHANCE_YOUR_CALM) and
    the address's newcomers are closed as they are accepted, until its
    budget is positive again: an attack costs its own address, not the
    probes of others. Each round of the loop serves the ready connections
    of the addresses with the most budget left first, a read of
    _READ_BYTES each, and leaves the rest for the next round once it has
    spent _ROUND_CPU_S, so a probe waits for a slice of the loop, not for
    a flood's backlog. HEALTH_MAX_PEERS addresses are remembered, the
    least recently seen forgotten first;
  * connections: HEALTH_MAX_CONNECTIONS in all, HEALTH_MAX_CONNECTIONS_PER_PEER
    per address. Past its address's limit, a newcomer takes the place of
    one of that address's connections (one done with its calls first, then
    the oldest); past the total, of the oldest of the addresses holding the
    most (of any, if each of theirs is answering). The one closed is never
    one whose answer is in progress (a call has arrived and not yet been
    answered, or its answer is unsent); only when every candidate is
    answering is the newcomer itself closed. A probe's connection lives
    for milliseconds, so it is the newest, and no address can lock another
    out;
  * calls: HEALTH_MAX_STREAMS_PER_CONNECTION at once per connection (HTTP/2
    MAX_CONCURRENT_STREAMS); a request message is at most
    HEALTH_MAX_REQUEST_BYTES and must follow its headers within
    REQUEST_ARRIVAL_TIMEOUT_S, as on the gRPC port;
  * time: a connection must have a request answered within
    HEALTH_FIRST_REQUEST_TIMEOUT_S of connecting, and is closed once it has
    had none answered for HEALTH_IDLE_TIMEOUT_S and holds no Watch, or once
    it has carried HEALTH_MAX_CALLS_PER_CONNECTION calls; a Watch
    lasts the idle timeout (`--idle-timeout-s`, then ends with status OK)
    and a peer keeps at most MAX_WATCHES_PER_PEER open;
  * bytes: HEALTH_MAX_UNSENT_BYTES wait for a peer that does not read, then
    it is closed.
What peers do wrong is logged at most once per _LOG_PERIOD_S for each way
of doing it (proto/throttle.py); so is a bug met serving one (with its
traceback), which costs that connection alone. Whatever way a connection
ends (a reset before its greeting included), it leaves the loop's
selector before its socket is closed, so its descriptor, reused by the
next connection, is read again.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import ipaddress
import logging
import math
import selectors
import socket
import threading
import time
from typing import Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from google.protobuf import message as protobuf_message
from grpc_health.v1 import health_pb2 as pb

from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.serving.grpc_service import REQUEST_ARRIVAL_TIMEOUT_S
from grain_elevator.server.serving.health import (MAX_WATCHES_PER_PEER, SERVICE_NAME,
                                                  SERVICE_UNKNOWN)

log = logging.getLogger("grain_elevator.server")

HEALTH_MAX_CONNECTIONS = 128
# A kubelet probes each container from its node's address, a few probes at a
# time; a load balancer's checker from a few addresses.
HEALTH_MAX_CONNECTIONS_PER_PEER = 8
HEALTH_MAX_STREAMS_PER_CONNECTION = 4
# A probe sends its request as it connects; a second is far more than one needs.
HEALTH_FIRST_REQUEST_TIMEOUT_S = 2.0
HEALTH_IDLE_TIMEOUT_S = 10.0
# A HealthCheckRequest holds a service name; a probe's headers are a few
# hundred bytes.
HEALTH_MAX_REQUEST_BYTES = 1024
HEALTH_MAX_HEADER_LIST_BYTES = 8 << 10
# A probe costs the loop about a millisecond of CPU (0.3-1.5 ms measured,
# connection included); an address may spend a few hundred probes' worth at
# once and 5% of a core for good. Rapid reset, PING, SETTINGS and HPACK
# floods cost far more per byte than a probe: they spend it in milliseconds.
HEALTH_PEER_CPU_BURST_S = 0.25
HEALTH_PEER_CPU_REFILL_S = 5.0  # to refill the whole burst: 5% of a core
HEALTH_MAX_PEERS = 4096
HEALTH_MAX_UNSENT_BYTES = 64 << 10
# Then the connection is closed once its calls are over (GOAWAY; a client
# opens another): what h2 keeps of a connection's past streams stays small.
HEALTH_MAX_CALLS_PER_CONNECTION = 1000

_CHECK, _LIST, _WATCH = (f"/{SERVICE_NAME}/{m}" for m in ("Check", "List", "Watch"))
_OK, _INVALID_ARGUMENT, _NOT_FOUND, _RESOURCE_EXHAUSTED, _UNIMPLEMENTED = 0, 3, 5, 8, 12
_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_TICK_S = 0.05  # how often deadlines are checked, and Watch streams told of a change
_IDLE_WAIT_S = 1.0
_ACCEPTS_PER_TICK = 64  # then the connections already open have their turn
# Refusing one costs an accept and a close: a round refuses as many as the
# listen backlog holds, so that a probe queued behind a flood of refused
# connections is accepted in the next round, not after many.
_BACKLOG = 1024
_ACCEPT_PAUSE_S = 0.1  # out of descriptors: accepting waits this long
_LOG_PERIOD_S = 10.0
_READ_BYTES = 4 << 10  # one read of one connection: ~10 ms of the worst frames
_ROUND_CPU_S = 0.01  # a round's share of the loop before it selects again


@dataclasses.dataclass(eq=False)
class _Call:
  """One call (HTTP/2 stream) on a connection."""
  method: str
  arrived: float
  body: bytearray = dataclasses.field(default_factory=bytearray)
  answered: bool = False  # its reply (or, for Watch, its first message) is sent
  half_closed: bool = False  # the client has ended its side
  service: str = ""
  watch_until: float = math.inf  # a Watch: when it ends
  sent: int | None = None  # a Watch: the status last sent


@dataclasses.dataclass(eq=False)
class _Peer:
  """A client address: its connections and what it may still cost the loop."""
  key: str  # the address, or an IPv6 one's /64
  conns: list[_Connection] = dataclasses.field(default_factory=list)  # oldest first
  budget: float = HEALTH_PEER_CPU_BURST_S  # CPU seconds, as of budget_at
  budget_at: float = 0.0
  refused: int = 0  # newcomers closed while it was in debt

  def level(self, now: float) -> float:
    """Its budget now."""
    return min(HEALTH_PEER_CPU_BURST_S, self.budget + (now - self.budget_at)
               * HEALTH_PEER_CPU_BURST_S / HEALTH_PEER_CPU_REFILL_S)

  def charge(self, now: float, cpu_s: float) -> float:
    """Takes `cpu_s` from its budget; returns what is left."""
    self.budget, self.budget_at = self.level(now) - cpu_s, now
    return self.budget


@dataclasses.dataclass(eq=False)
class _Connection:
  sock: socket.socket
  peer: _Peer
  h2: h2.connection.H2Connection
  opened: float
  answered_at: float  # when a request was last answered (or it connected)
  served: int = 0  # requests answered
  opened_calls: int = 0
  calls: dict[int, _Call] = dataclasses.field(default_factory=dict)
  unsent: bytearray = dataclasses.field(default_factory=bytearray)
  writing: bool = False  # registered for EVENT_WRITE too

  def watches(self) -> int:
    return sum(1 for c in self.calls.values() if c.method == _WATCH and c.answered)

  def answering(self) -> bool:
    """A call of its has arrived and is not answered yet, or an answer is unsent."""
    return bool(self.unsent) or any(not c.answered for c in self.calls.values())

  def spare_rank(self) -> tuple[int, float] | None:
    """Which to close first for a newcomer (lowest first); None: never."""
    if self.answering():
      return None
    if self.served and not self.calls:
      return (0, self.opened)  # done: its client is about to close it
    # Then the oldest: the newest may be a probe that has not sent its
    # request yet (it cannot before the server's SETTINGS).
    return (1, self.opened)


class _Closed(Exception):
  """The connection is done for: `why` is one of a few fixed words (the log
  line is throttled per word)."""

  def __init__(self, why: str, message: str = ""):
    super().__init__(message or why)
    self.why = why


class HealthPort:
  """Serves grpc.health.v1.Health on a port of its own, from one thread.

  `status()`: the server's status now (SERVING or NOT_SERVING), for each of
  `services`; other service names are NOT_FOUND (Check) or SERVICE_UNKNOWN
  (Watch). `watch_s`: how long a Watch lasts."""

  def __init__(self, status: Callable[[], int], services: tuple[str, ...], *,
               watch_s: float):
    self._status = status
    self._services = services
    self._watch_s = watch_s
    self._listener: socket.socket | None = None
    self.port: int | None = None
    self._selector = selectors.DefaultSelector()
    self._wake_r, self._wake_w = socket.socketpair()
    self._wake_r.setblocking(False)
    self._stopping = False
    self._thread = threading.Thread(target=self._loop, name="elevator-health-port",
                                    daemon=True)
    # The loop thread's alone:
    self._conns: dict[_Connection, None] = {}  # oldest first
    # By key, least recently seen first; those without connections are
    # forgotten past HEALTH_MAX_PEERS.
    self._peers: collections.OrderedDict[str, _Peer] = collections.OrderedDict()
    self._accept_again_at = 0.0  # > 0: accepting is paused until then
    self._throttled = Throttled(_LOG_PERIOD_S, log)

  def start(self, host: str, port: int) -> int:
    """Listens on host:port (0: a free port) and serves; returns the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._listener = socket.create_server((host, port), family=family, backlog=_BACKLOG)
    self._listener.setblocking(False)
    self.port = self._listener.getsockname()[1]
    self._selector.register(self._listener, selectors.EVENT_READ, "accept")
    self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
    self._thread.start()
    return self.port

  def stop(self) -> None:
    """Closes every connection (GOAWAY) and the listener."""
    self._stopping = True
    try:
      self._wake_w.send(b"x")
    except OSError:
      pass
    if self._thread.is_alive():
      self._thread.join(timeout=5)
    for conn in list(self._conns):
      self._close(conn)
    if self._listener is not None:
      self._listener.close()
    self._selector.close()
    self._wake_r.close()
    self._wake_w.close()

  # The loop ------------------------------------------------------------------

  def _loop(self) -> None:
    next_tick = 0.0
    while not self._stopping:
      # With no connection there are no deadlines: wait for one (or `stop`).
      timeout = _TICK_S if self._conns or self._accept_again_at else _IDLE_WAIT_S
      ready: list[tuple[_Connection, int]] = []
      for key, mask in self._selector.select(timeout=timeout):
        if key.data == "accept":
          try:
            self._accept()
          except Exception as e:  # pylint: disable=broad-except
            self._bug("accepting", e)
        elif key.data != "wake":  # "wake": `stop`
          ready.append((key.data, mask))
      now = time.monotonic()
      # The thriftiest addresses first; what is left waits for the next round
      # (still ready, the selector reports it again).
      ready.sort(key=lambda conn_mask: -conn_mask[0].peer.level(now))
      began = time.thread_time()
      for conn, mask in ready:
        if time.thread_time() - began > _ROUND_CPU_S:
          break
        self._guarded(conn, self._serve, mask)
      now = time.monotonic()
      if now >= next_tick:
        next_tick = now + _TICK_S
        if self._accept_again_at and now >= self._accept_again_at:
          self._accept_again_at = 0.0
          self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        status: list[int] = []  # asked once per tick, if a Watch needs it
        for conn in list(self._conns):
          self._guarded(conn, self._tick, now, status)

  def _guarded(self, conn: _Connection, step: Callable[..., None], *args: object) -> None:
    """`step(conn, *args)`, its CPU charged to the connection's address;
    what goes wrong costs that connection alone."""
    if conn not in self._conns:
      return  # closed by an earlier event of this round
    began = time.thread_time()
    try:
      step(conn, *args)
    except _Closed as e:
      self._cut(conn, e)
    except (OSError, h2.exceptions.ProtocolError):  # gone, or not HTTP/2 (h2 said GOAWAY)
      self._close(conn)
    except Exception as e:  # pylint: disable=broad-except
      self._bug(f"serving a connection of {conn.peer.key}", e)
      self._close(conn, h2.errors.ErrorCodes.INTERNAL_ERROR)
    if conn.peer.charge(time.monotonic(), time.thread_time() - began) < 0:
      self._cut(conn, _Closed("budget", f"it cost the loop more than "
                              f"{HEALTH_PEER_CPU_BURST_S:g}s of CPU within "
                              f"{HEALTH_PEER_CPU_REFILL_S:g}s; it is refused until "
                              "that is paid back"))

  def _cut(self, conn: _Connection, why: _Closed) -> None:
    """Closes a connection for what its peer did (throttled log line)."""
    if conn in self._conns:
      self._throttled.warning(("closed", why.why), "health port: closed a connection of "
                              "%s: %s", conn.peer.key, why)
      self._close(conn, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)

  def _bug(self, doing: str, e: Exception) -> None:
    """A bug met serving: its traceback, once per period and kind."""
    self._throttled.warning(("bug", type(e).__name__), "health port: %s failed (a bug; "
                            "the port serves on): %s", doing, e, exc_info=True)

  def _serve(self, conn: _Connection, mask: int) -> None:
    """What a connection's socket is ready for."""
    if mask & selectors.EVENT_READ:
      self._receive(conn)
    self._flush(conn)

  def _tick(self, conn: _Connection, now: float, status: list[int]) -> None:
    """A connection's deadlines, and its Watch streams told of a change.
    `status`: the server's status, once asked this tick ([] until then)."""
    for stream_id, call in list(conn.calls.items()):
      if not call.answered and now - call.arrived > REQUEST_ARRIVAL_TIMEOUT_S:
        conn.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        del conn.calls[stream_id]
      elif call.method == _WATCH and call.answered:
        if now >= call.watch_until:
          self._end(conn, stream_id, _OK, "a Watch lasts --idle-timeout-s; open another")
          conn.answered_at = now
          continue
        if not status:
          status.append(self._status())
        self._watch_update(conn, stream_id, call, status[0])
    if not conn.watches():
      limit = HEALTH_IDLE_TIMEOUT_S if conn.served else HEALTH_FIRST_REQUEST_TIMEOUT_S
      if now - conn.answered_at > limit or (
          conn.opened_calls >= HEALTH_MAX_CALLS_PER_CONNECTION and not conn.calls):
        self._close(conn)
        return
    self._flush(conn)

  # Connections ---------------------------------------------------------------

  def _accept(self) -> None:
    assert self._listener is not None
    admitted = 0
    for _ in range(_BACKLOG):
      if admitted >= _ACCEPTS_PER_TICK:
        return
      try:
        sock, address = self._listener.accept()
      except (BlockingIOError, InterruptedError):
        return
      except ConnectionAbortedError:
        continue
      except OSError as e:  # EMFILE and the like: the listener stays readable
        self._selector.unregister(self._listener)
        self._accept_again_at = time.monotonic() + _ACCEPT_PAUSE_S
        hint = (" (raise the open-files limit)" if e.errno in (errno.EMFILE, errno.ENFILE)
                else "")
        self._throttled.warning(("accept", e.errno), "health port: cannot accept a "
                                "connection: %s%s", e, hint)
        return
      now = time.monotonic()
      peer = self._peer(address[0])
      if peer.level(now) < 0:
        peer.refused += 1
        self._throttled.warning(("refused", "budget"), "health port: refused a connection "
                                "of %s: it has cost the loop more than its budget "
                                "(%d refused so far)", peer.key, peer.refused)
        sock.close()
        continue
      admitted += 1
      try:
        self._admit(sock, peer, now)
      except Exception as e:  # pylint: disable=broad-except
        self._bug("admitting a connection", e)
        sock.close()

  def _peer(self, address: str) -> _Peer:
    """The _Peer of `address`, made if new, marked as seen just now."""
    key = _peer_key(address)
    peer = self._peers.get(key)
    if peer is None:
      if len(self._peers) >= HEALTH_MAX_PEERS:  # forget the least recently seen idle one
        for old in self._peers.values():
          if not old.conns:
            del self._peers[old.key]
            break
      peer = self._peers[key] = _Peer(key, budget_at=time.monotonic())
    self._peers.move_to_end(key)
    return peer

  def _admit(self, sock: socket.socket, peer: _Peer, now: float) -> None:
    """Makes room for the newcomer (module docstring) and greets it; or
    closes it, when every connection that could make room is answering."""
    victim: _Connection | None = None
    if len(peer.conns) >= HEALTH_MAX_CONNECTIONS_PER_PEER:
      victim = _spare(peer.conns)
      self._throttled.warning(("peer", victim is None), "health port: %s has %d connections "
                              "open; %s", peer.key, len(peer.conns), "each is answering: "
                              "closing its newcomer" if victim is None else
                              "closing one for its newcomer")
      if victim is None:
        sock.close()
        return
    elif len(self._conns) >= HEALTH_MAX_CONNECTIONS:
      victim = self._spare_of_most()
      self._throttled.warning(("full", victim is None), "health port: %d connections open; "
                              "%s", len(self._conns), "each is answering: closing the "
                              "newcomer" if victim is None else "closing one of "
                              f"{victim.peer.key}, which has {len(victim.peer.conns)}")
      if victim is None:
        sock.close()
        return
    if victim is not None:
      self._close(victim)
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    conn = h2.connection.H2Connection(config)
    conn.local_settings = h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: HEALTH_MAX_STREAMS_PER_CONNECTION,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: HEALTH_MAX_HEADER_LIST_BYTES,
    })
    conn.decoder.max_header_list_size = HEALTH_MAX_HEADER_LIST_BYTES  # decoded
    conn.initiate_connection()
    c = _Connection(sock, peer, conn, opened=now, answered_at=now)
    self._conns[c] = None
    peer.conns.append(c)
    try:
      self._selector.register(sock, selectors.EVENT_READ, c)
      sock.setblocking(False)
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      self._flush(c)
    except OSError:  # reset before it was greeted: out of the selector, then closed
      self._close(c)
    except BaseException:
      self._close(c)
      raise

  def _spare_of_most(self) -> _Connection | None:
    """For a newcomer past the total: the oldest connection not answering of
    the addresses holding the most, else the oldest not answering of any."""
    most = max(len(p.conns) for p in {c.peer for c in self._conns})
    oldest = None
    for c in self._conns:  # oldest first
      if not c.answering():
        if len(c.peer.conns) == most:
          return c
        oldest = oldest or c
    return oldest

  def _close(self, conn: _Connection,
             error: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
    """GOAWAY (as far as the socket takes it now), then closed."""
    if conn not in self._conns:
      return
    del self._conns[conn]
    conn.peer.conns.remove(conn)
    try:
      self._selector.unregister(conn.sock)  # first: its descriptor is reused once closed
    except (KeyError, ValueError):
      pass
    try:
      conn.h2.close_connection(error)
      conn.sock.send(conn.unsent + conn.h2.data_to_send())
    except (OSError, h2.exceptions.ProtocolError):
      pass
    conn.sock.close()

  def _receive(self, conn: _Connection) -> None:
    now = time.monotonic()
    data = conn.sock.recv(_READ_BYTES)  # the rest, next round
    if not data:
      raise ConnectionResetError("the client closed the connection")
    for event in conn.h2.receive_data(data):
      self._on_event(conn, event, now)

  def _flush(self, conn: _Connection) -> None:
    """Sends what the socket takes now; waits for EVENT_WRITE for the rest."""
    conn.unsent += conn.h2.data_to_send()
    if conn.unsent:
      try:
        del conn.unsent[:conn.sock.send(conn.unsent)]
      except BlockingIOError:
        pass
    if len(conn.unsent) > HEALTH_MAX_UNSENT_BYTES:
      raise _Closed("not reading", f"{len(conn.unsent)} bytes unread")
    if bool(conn.unsent) != conn.writing:
      conn.writing = bool(conn.unsent)
      events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
      self._selector.modify(conn.sock, events, conn)

  # Calls ---------------------------------------------------------------------

  def _on_event(self, conn: _Connection, event: h2.events.Event, now: float) -> None:
    if isinstance(event, h2.events.RequestReceived):
      headers = dict(event.headers)
      path = headers.get(b":path", b"").decode("ascii", "replace")
      conn.opened_calls += 1
      conn.calls[event.stream_id] = _Call(path, arrived=now,
                                          half_closed=event.stream_ended is not None)
      if headers.get(b":method") != b"POST" or path not in (_CHECK, _LIST, _WATCH):
        self._end(conn, event.stream_id, _UNIMPLEMENTED,
                  f"the health port serves {SERVICE_NAME} only, not {path[:100]!r}")
    elif isinstance(event, h2.events.DataReceived):
      conn.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
      call = conn.calls.get(event.stream_id)
      if call is not None and not call.answered:
        call.half_closed |= event.stream_ended is not None
        call.body += event.data
        self._on_body(conn, event.stream_id, call, now)
    elif isinstance(event, h2.events.StreamEnded):
      call = conn.calls.get(event.stream_id)
      if call is not None:
        call.half_closed = True
        if not call.answered:
          self._end(conn, event.stream_id, _INVALID_ARGUMENT,
                    "the call ended without a request message")
    elif isinstance(event, h2.events.StreamReset):
      conn.calls.pop(event.stream_id, None)
    elif isinstance(event, h2.events.ConnectionTerminated):
      raise ConnectionResetError("the client said GOAWAY")

  def _on_body(self, conn: _Connection, stream_id: int, call: _Call, now: float) -> None:
    """Answers once the request message is whole."""
    body = call.body
    if len(body) < 5:
      return
    size = int.from_bytes(body[1:5], "big")
    if size > HEALTH_MAX_REQUEST_BYTES:
      self._end(conn, stream_id, _RESOURCE_EXHAUSTED, f"a request of {size} bytes; the "
                f"health port takes at most {HEALTH_MAX_REQUEST_BYTES}")
    elif body[0] != 0:
      self._end(conn, stream_id, _UNIMPLEMENTED, "the health port takes uncompressed "
                "requests only")
    elif len(body) >= 5 + size:
      self._answer(conn, stream_id, call, bytes(body[5:5 + size]), now)

  def _answer(self, conn: _Connection, stream_id: int, call: _Call, raw: bytes,
              now: float) -> None:
    kind = pb.HealthListRequest if call.method == _LIST else pb.HealthCheckRequest
    try:
      request = kind.FromString(raw)
    except protobuf_message.DecodeError as e:
      self._end(conn, stream_id, _INVALID_ARGUMENT,
                f"the request is not a {kind.DESCRIPTOR.full_name}: {e}")
      return
    conn.served += 1
    conn.answered_at = now
    status = self._status()
    if call.method == _LIST:
      reply = pb.HealthListResponse(
          statuses={s: pb.HealthCheckResponse(status=status) for s in self._services})
      self._reply(conn, stream_id, call, reply.SerializeToString())
      return
    service = request.service  # type: ignore[union-attr]
    if call.method == _CHECK:
      if service not in self._services:
        self._end(conn, stream_id, _NOT_FOUND, f"unknown service {service[:100]!r}")
      else:
        self._reply(conn, stream_id, call,
                    pb.HealthCheckResponse(status=status).SerializeToString())
      return
    watching = sum(c.watches() for c in conn.peer.conns)
    if watching >= MAX_WATCHES_PER_PEER:
      self._end(conn, stream_id, _RESOURCE_EXHAUSTED, f"{MAX_WATCHES_PER_PEER} health "
                f"Watch streams of {conn.peer.key} are open already")
      return
    call.service, call.watch_until = service, now + self._watch_s
    call.answered = True
    conn.h2.send_headers(stream_id, _RESPONSE_HEADERS)
    self._watch_update(conn, stream_id, call, status)

  def _watch_update(self, conn: _Connection, stream_id: int, call: _Call,
                    status: int) -> None:
    """Sends a Watch its status if that changed; a client that has not
    made room for it (flow control) is too slow to tell, and the stream ends."""
    status = status if call.service in self._services else SERVICE_UNKNOWN
    if status == call.sent:
      return
    data = _framed(pb.HealthCheckResponse(status=status).SerializeToString())
    if conn.h2.local_flow_control_window(stream_id) < len(data):
      conn.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
      del conn.calls[stream_id]
      return
    conn.h2.send_data(stream_id, data)
    call.sent = status

  def _reply(self, conn: _Connection, stream_id: int, call: _Call, message: bytes) -> None:
    call.answered = True
    conn.h2.send_headers(stream_id, _RESPONSE_HEADERS)
    conn.h2.send_data(stream_id, _framed(message))
    self._end(conn, stream_id, _OK)

  def _end(self, conn: _Connection, stream_id: int, code: int, message: str = "") -> None:
    """Ends a call with its status (trailers, or headers and trailers in one
    when nothing was sent); resets the stream if its client has not ended
    its side, so that it counts against MAX_CONCURRENT_STREAMS no more."""
    call = conn.calls.pop(stream_id)
    trailers = [(b"grpc-status", str(code).encode())]
    if message:
      trailers.append((b"grpc-message", _percent_encoded(message)))
    if not call.answered:
      trailers[:0] = _RESPONSE_HEADERS
    conn.h2.send_headers(stream_id, trailers, end_stream=True)
    if not call.half_closed:
      try:
        conn.h2.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
      except h2.exceptions.StreamClosedError:  # its END_STREAM came meanwhile
        pass


def _spare(conns: list[_Connection]) -> _Connection | None:
  """The connection to close for a newcomer (_Connection.spare_rank); None
  if each is answering."""
  ranked = [(rank, i) for i, c in enumerate(conns) if (rank := c.spare_rank()) is not None]
  return conns[min(ranked)[1]] if ranked else None


def _peer_key(address: str) -> str:
  """What budgets are kept for: an IPv4 address (an IPv4-mapped IPv6 one
  too), or an IPv6 address's /64, which one host holds whole."""
  if ":" not in address:
    return address
  try:
    ip = ipaddress.IPv6Address(address.split("%")[0])
  except ValueError:
    return address
  if ip.ipv4_mapped is not None:
    return str(ip.ipv4_mapped)
  return str(ipaddress.IPv6Network((ip, 64), strict=False))


def _framed(message: bytes) -> bytes:
  """A gRPC message: uncompressed, its length, itself."""
  return b"\0" + len(message).to_bytes(4, "big") + message


def _percent_encoded(text: str) -> bytes:
  """grpc-message's encoding: printable ASCII but '%' as it is, the rest %XX."""
  return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
                  for b in text.encode())
