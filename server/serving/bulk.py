"""The bulk transport's server: GetBatches over plain TCP, beside gRPC.

gRPC costs the receiving trainer several times the CPU per GB of a plain
socket (BENCHMARKS.md: the "client CPU s/GB" column, gRPC against bulk
rows). This serves the
same requests with the same Batch bytes and status codes over a socket. It
is a thin adapter: authentication, admission, validation and status mapping
are the request path's (server/serving/request_path.py).

What a connection costs is bounded, whatever its peer does:
  * one loop thread owns every connection that is not running a request: it
    accepts, greets, reads request frames without blocking, and closes
    connections idle for `idle_timeout_s` (or silent for HANDSHAKE_TIMEOUT_S
    after connecting). An idle connection costs a socket, no thread;
  * a request frame is at most MAX_REQUEST_BYTES, checked from its
    header before its buffer exists, and before the token inside it is;
  * a request runs on a pool of `threads` threads once admission gives it a
    ticket (so the pool never queues); one request at a time per connection;
  * admission cancels a request whose client stops reading (its write
    timeout, server/serving/admission.py) by shutting the socket down;
  * past `max_connections`, the longest-idle connection is closed to admit
    a new one, so idle sockets cannot lock clients out; past `max_per_peer`
    connections of one client address, that address's longest-idle one is
    (or the newcomer, when all of them are busy), so one address cannot
    take the cap;
  * out of descriptors (EMFILE, ENFILE), the loop stops accepting for a
    backoff (_ACCEPT_BACKOFF_S) instead of retrying at once, so the
    connections waiting in the listen queue cost no CPU;
  * a failure while serving one connection (its peer's fault, or a bug)
    closes that connection and no other; what peers do wrong is logged at
    most once per _LOG_PERIOD_S for each way of doing it (proto/throttle.py),
    so a flood of them cannot flood the log.
Waits are epoll (the loop) and poll (a request's thread), which take any
descriptor number: a worker may hold thousands of sockets.
Workers share the port with SO_REUSEPORT, like the gRPC port.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import queue
import select
import selectors
import socket
import threading
import time
from concurrent import futures

from google.protobuf import message as protobuf_message

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import framing
from grain_elevator.proto.limits import MAX_REQUEST_BYTES
from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.serving import sockets
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.admission import Ticket
from grain_elevator.server.serving.request_path import RequestPath

log = logging.getLogger("grain_elevator.server")
HANDSHAKE_TIMEOUT_S = 10.0
# After a request, how long its thread waits for the connection's next one
# before handing the connection back to the loop.
_FOLLOW_ON_WAIT_S = 0.02
# Out of descriptors, the listener stays readable: accepting is paused for
# the first pause, doubled at each failure up to the last, until one works.
# Short enough that a freed descriptor is used soon, long enough that the
# retries cost nothing.
_ACCEPT_BACKOFF_S = (0.05, 1.0)
# Peers that break the protocol, connections past the cap, descriptors
# running out: each comes by the thousand under attack.
_LOG_PERIOD_S = 10.0


class _Reading(enum.Enum):
  """What a connection's buffer is filling with. (Not told apart by its size:
  a request payload can be as long as a frame header.)"""
  GREETING = enum.auto()
  HEADER = enum.auto()
  PAYLOAD = enum.auto()


@dataclasses.dataclass(eq=False)
class _Connection:
  """One peer, as the loop sees it between requests."""
  sock: socket.socket
  peer: str  # the client's address, without its port
  deadline: float
  reading: _Reading = _Reading.GREETING
  busy: bool = False
  buffer: bytearray = dataclasses.field(default_factory=bytearray)
  need: int = len(framing.MAGIC)
  last_request: float = dataclasses.field(default_factory=time.monotonic)


class _Dropped(framing.ProtocolError):
  """The peer broke the protocol, so its connection is dropped. `why` is one
  of a few fixed words: the log line is throttled per `why`, so garbage of
  any shape logs a line a period for each way of breaking the protocol."""

  def __init__(self, why: str, message: str):
    super().__init__(message)
    self.why = why


def _send_now(sock: socket.socket, data: bytes) -> bool:
  """A small frame on a non-blocking socket: all of it, or False."""
  try:
    return sock.send(data) == len(data)
  except OSError:
    return False


def _status_frame(error: errors.ElevatorError) -> bytes:
  code, message, type_name = errors.status_of(error)
  metrics.current().error(code.name)
  payload = pb.BulkStatus(code=code.value[0], message=message,
                          error_type=type_name).SerializeToString()
  return framing.frame(framing.STATUS, payload)


class BulkServer:
  """Listens on `host:port` and serves the request path to each connection."""

  def __init__(self, path: RequestPath, host: str, port: int, *, idle_timeout_s: float,
               max_connections: int, threads: int, max_per_peer: int | None = None):
    """`idle_timeout_s`, `max_connections`, `max_per_peer` and `threads` are
    ServerOptions' idle_timeout_s, max_bulk_connections,
    max_bulk_connections_per_peer and max_concurrent_requests."""
    self._listener = sockets.bind_shared(host, port)
    self._listener.listen(1024)
    self._listener.setblocking(False)
    self.port: int = self._listener.getsockname()[1]
    self._path = path
    self._idle_timeout_s = idle_timeout_s
    self._max_connections = max_connections
    self._max_per_peer = max_per_peer or max_connections
    # 4x the slots: a thread waiting _FOLLOW_ON_WAIT_S for a follow-on
    # request holds no slot, and admitted requests must never queue.
    self._pool = futures.ThreadPoolExecutor(4 * threads, "elevator-bulk")
    self._selector = selectors.DefaultSelector()
    self._wake_r, self._wake_w = socket.socketpair()
    self._wake_r.setblocking(False)
    self._returned: queue.SimpleQueue[_Connection] = queue.SimpleQueue()
    self._lock = threading.Lock()  # guards _conns, _by_peer and _stopping
    self._conns: set[_Connection] = set()
    self._by_peer: dict[str, set[_Connection]] = {}
    self._stopping = False
    # The loop's alone: whether the listener is polled, else when it is again.
    self._accepting = True
    self._accept_pause_s = 0.0
    self._accept_again_at = 0.0
    self._throttled = Throttled(_LOG_PERIOD_S, log)
    self._thread = threading.Thread(target=self._loop, name="elevator-bulk-loop",
                                    daemon=True)

  def start(self) -> None:
    self._selector.register(self._listener, selectors.EVENT_READ, "accept")
    self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
    self._thread.start()

  # The loop ------------------------------------------------------------------

  def _loop(self) -> None:
    while not self._stopping:
      timeout = 1.0
      if not self._accepting:
        pause = self._accept_again_at - time.monotonic()
        if pause <= 0:
          self._selector.register(self._listener, selectors.EVENT_READ, "accept")
          self._accepting = True
        else:
          timeout = min(timeout, pause)
      for key, _ in self._selector.select(timeout=timeout):
        self._handle(key.data)
      self._expire(time.monotonic())
    self._selector.close()

  def _handle(self, what: str | _Connection) -> None:
    try:
      if what == "accept":
        self._accept()
      elif what == "wake":
        self._take_back()
      else:
        self._on_readable(what)
    except Exception:  # pylint: disable=broad-except
      # A bug here must cost one connection, not the port.
      if isinstance(what, _Connection):
        log.exception("bulk connection closed: handling it failed")
        self._close(what)
      else:
        log.exception("bulk port: handling an event failed")

  def _accept(self) -> None:
    while True:
      try:
        sock, address = self._listener.accept()
      except (BlockingIOError, InterruptedError):
        return
      except ConnectionAbortedError:  # reset while queued: the next one
        continue
      except OSError as e:  # EMFILE and the like: the listener stays readable
        self._pause_accepting(e)
        return
      self._accept_pause_s = 0.0
      try:
        self._greet(sock, address[0])
      except OSError:  # reset before it was greeted
        sock.close()

  def _pause_accepting(self, error: OSError) -> None:
    first, last = _ACCEPT_BACKOFF_S
    self._accept_pause_s = min(last, max(first, 2 * self._accept_pause_s))
    self._selector.unregister(self._listener)
    self._accepting = False
    self._accept_again_at = time.monotonic() + self._accept_pause_s
    hint = (" (raise the open-files limit, or lower --max-bulk-connections)"
            if error.errno in (errno.EMFILE, errno.ENFILE) else "")
    self._throttled.warning(
        ("accept", error.errno),
        "bulk port: cannot accept a connection: %s%s; trying again in up to %gs",
        error, hint, last)

  def _greet(self, sock: socket.socket, peer: str) -> None:
    if not self._make_room(peer):
      sock.close()
      return
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not _send_now(sock, framing.MAGIC):
      sock.close()
      return
    conn = _Connection(sock, peer, deadline=time.monotonic() + HANDSHAKE_TIMEOUT_S)
    self._selector.register(sock, selectors.EVENT_READ, conn)
    with self._lock:
      self._conns.add(conn)
      self._by_peer.setdefault(peer, set()).add(conn)

  def _make_room(self, peer: str) -> bool:
    """Whether a new connection from `peer` fits, closing the longest-idle
    one of that peer (at max_per_peer) or of all (at max_connections) if not."""
    with self._lock:
      mine = self._by_peer.get(peer, set())
      if len(mine) >= self._max_per_peer:
        key, idle = "peer", [c for c in mine if not c.busy]
        what = f"{peer} has {len(mine)} connections open (--max-bulk-connections-per-peer)"
      elif len(self._conns) >= self._max_connections:
        key, idle = "full", [c for c in self._conns if not c.busy]
        what = f"{len(self._conns)} connections open (--max-bulk-connections)"
      else:
        return True
    if not idle:
      self._throttled.warning(key, "bulk port: %s; refusing a new one: all are busy", what)
      return False
    self._throttled.warning(
        key, "bulk port: %s; closing the longest idle one to admit a new one", what)
    self._close(min(idle, key=lambda c: c.last_request))
    return True

  def _forget(self, conn: _Connection) -> None:
    """Counts `conn` no more (under self._lock)."""
    self._conns.discard(conn)
    mine = self._by_peer.get(conn.peer)
    if mine is not None:
      mine.discard(conn)
      if not mine:
        del self._by_peer[conn.peer]

  def _on_readable(self, conn: _Connection) -> None:
    try:
      data = conn.sock.recv(conn.need - len(conn.buffer))
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      data = b""
    if not data:  # the client went away
      self._close(conn)
      return
    conn.buffer += data
    if len(conn.buffer) < conn.need:
      return
    try:
      self._advance(conn)
    except _Dropped as e:
      self._log_dropped(e)
      self._close(conn)

  def _advance(self, conn: _Connection) -> None:
    """A complete piece arrived: the magic, a frame header or a payload."""
    if conn.reading is _Reading.GREETING:
      if bytes(conn.buffer) != framing.MAGIC:
        raise _Dropped("not bulk", f"peer sent {bytes(conn.buffer)!r}, not the bulk "
                       f"protocol's {framing.MAGIC!r}")
      conn.deadline = time.monotonic() + self._idle_timeout_s
      hello = self._path.server_info.SerializeToString()
      if not _send_now(conn.sock, framing.frame(framing.HELLO, hello)):
        raise _Dropped("not reading", "the client does not read its greeting")
      self._expect(conn, _Reading.HEADER, framing.HEADER_SIZE)
    elif conn.reading is _Reading.HEADER:
      try:
        _, size = framing.check_header(conn.buffer, (framing.REQUEST,), MAX_REQUEST_BYTES)
      except framing.ProtocolError as e:
        raise _Dropped("size" if isinstance(e, framing.FrameTooLarge) else "kind",
                       str(e)) from e
      self._expect(conn, _Reading.PAYLOAD, size)
      if size == 0:  # recv(0) would read as the peer hanging up
        self._dispatch(conn, b"")
    else:
      self._dispatch(conn, bytes(conn.buffer))

  def _expect(self, conn: _Connection, reading: _Reading, size: int) -> None:
    conn.reading = reading
    conn.buffer = bytearray()
    conn.need = size

  def _dispatch(self, conn: _Connection, payload: bytes) -> None:
    """A whole request: refused here, or handed to a thread with its ticket."""
    self._expect(conn, _Reading.HEADER, framing.HEADER_SIZE)
    ticket = self._admit(conn, payload, blocking=False)
    if ticket is None:
      return
    conn.busy = True
    self._selector.unregister(conn.sock)
    try:
      self._pool.submit(self._serve, conn, ticket)
    except BaseException:
      ticket.release()  # else its slot is never given back
      raise

  def _take_back(self) -> None:
    """Connections whose request ended return to the loop."""
    try:
      while self._wake_r.recv(4096):
        pass
    except (BlockingIOError, InterruptedError):
      pass
    while True:
      try:
        conn = self._returned.get_nowait()
      except queue.Empty:
        return
      conn.busy = False
      conn.deadline = time.monotonic() + self._idle_timeout_s
      try:
        conn.sock.setblocking(False)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
      except (OSError, ValueError):  # stop() closed it meanwhile
        self._close(conn)
      except Exception:  # pylint: disable=broad-except
        # Not raised: the connections still queued would be lost, busy.
        log.exception("bulk connection closed: taking it back failed")
        self._close(conn)

  def _expire(self, now: float) -> None:
    with self._lock:
      late = [c for c in self._conns if not c.busy and now >= c.deadline]
    for conn in late:
      self._close(conn)

  def _close(self, conn: _Connection) -> None:
    with self._lock:
      self._forget(conn)
    if not conn.busy:
      try:
        self._selector.unregister(conn.sock)
      except (KeyError, ValueError):
        pass
    _close_socket(conn.sock)

  def _log_dropped(self, error: _Dropped) -> None:
    self._throttled.warning(("dropped", error.why), "bulk connection dropped: %s", error)

  # A request, on a pool thread ----------------------------------------------

  def _serve(self, conn: _Connection, ticket: Ticket) -> None:
    """Runs the ticket's request and the follow-ons (_serve_while_they_come),
    then gives the connection back to the loop, or closes it."""
    keep = False
    try:
      keep = self._serve_while_they_come(conn, ticket)
    except Exception:  # pylint: disable=broad-except
      # The pool would swallow it, leaving the connection busy (which no
      # timeout closes) and its socket open: a bug costs this one connection.
      log.exception("bulk connection closed: serving it failed")
    if not keep:
      with self._lock:
        self._forget(conn)
      _close_socket(conn.sock)
      return
    self._returned.put(conn)
    try:
      self._wake_w.send(b"x")
    except OSError:
      pass

  def _serve_while_they_come(self, conn: _Connection, ticket: Ticket) -> bool:
    """Runs `ticket`'s request, then the connection's next ones while they
    arrive at once (a trainer sends its next request as it reads the last
    batch; handing the connection back to the loop for it costs ~10% on
    one-step requests). Whether the loop should have the connection again."""
    sock = conn.sock
    # Blocking sends (a timeout would cost a poll before each): a client that
    # stops reading is cut by admission's write timeout, which shuts the
    # socket down and so wakes the send.
    sock.setblocking(True)
    while True:
      done = self._run(sock, ticket.request, ticket)
      if not done or ticket.cancelled or self._stopping:
        return False
      try:
        follow_on = self._next_request(conn)
      except _Dropped as e:
        self._log_dropped(e)
        return False
      except OSError:  # the client went away
        return False
      if follow_on is None:
        return True
      ticket = follow_on

  def _run(self, sock: socket.socket, request: pb.BatchRequest, ticket: Ticket) -> bool:
    """Streams one request; False if the connection is done for."""
    try:
      try:
        recorded = metrics.current()
        for parts in self._path.encoded_steps(ticket, request, lambda: not ticket.released):
          with ticket.waiting():
            size = framing.send_frame(sock, framing.BATCH, parts)
          recorded.sent(request.dataset, "bulk", size)
      except errors.ElevatorError as e:
        sock.sendall(_status_frame(e))
      return True
    except OSError:
      return False  # gone, cancelled, or not reading
    except Exception:  # pylint: disable=broad-except
      log.exception("bulk request failed")
      return False
    finally:
      ticket.release()

  def _next_request(self, conn: _Connection) -> Ticket | None:
    """The admitted ticket of the connection's next request, if the whole of
    it arrives within _FOLLOW_ON_WAIT_S; None leaves it to the loop (which
    also reads requests that come in pieces). A refused request is answered
    here and the wait starts again."""
    sock = conn.sock
    # poll, not select: select refuses descriptors past 1023.
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while poller.poll(_FOLLOW_ON_WAIT_S * 1000):
      try:
        data = sock.recv(framing.HEADER_SIZE + MAX_REQUEST_BYTES,
                         socket.MSG_PEEK | socket.MSG_DONTWAIT)
      except BlockingIOError:
        return None
      if not data:
        raise ConnectionResetError("the client closed the connection")
      if len(data) < framing.HEADER_SIZE:
        return None
      try:
        _, size = framing.check_header(data[:framing.HEADER_SIZE], (framing.REQUEST,),
                                       MAX_REQUEST_BYTES)
      except framing.ProtocolError:
        return None  # the loop refuses it, as for any other
      end = framing.HEADER_SIZE + size
      if len(data) < end:
        return None
      framing.recv_into(sock, memoryview(bytearray(end)))  # consume what was peeked
      ticket = self._admit(conn, data[framing.HEADER_SIZE:end], blocking=True)
      if ticket is not None:
        return ticket
    return None

  def _admit(self, conn: _Connection, payload: bytes, *, blocking: bool) -> Ticket | None:
    """Parses, authenticates and admits a request; answers a refusal and
    returns None. The ticket carries the request."""
    try:
      request = pb.BulkRequest.FromString(payload)
    except protobuf_message.DecodeError as e:
      raise _Dropped("not protobuf", f"request frame is not a BulkRequest: {e}") from e
    conn.last_request = time.monotonic()
    conn.deadline = conn.last_request + self._idle_timeout_s
    sock = conn.sock
    try:
      ticket = self._path.admit(request.auth_token or None, lambda: _shutdown(sock),
                                steps=request.request.num_steps)
    except errors.ElevatorError as e:
      status = _status_frame(e)
      if blocking:
        sock.sendall(status)
      elif not _send_now(sock, status):
        raise _Dropped("not reading", "the client does not read its answer") from e
      return None
    ticket.request = request.request
    return ticket

  def stop(self, grace_s: float) -> None:
    """Stops accepting, lets requests in flight finish within `grace_s`, then
    closes every connection. (The request path refuses new requests already.)"""
    with self._lock:
      self._stopping = True
    try:
      self._wake_w.send(b"x")
    except OSError:
      pass
    self._thread.join(timeout=5)
    self._listener.close()
    with self._lock:
      idle = [c for c in self._conns if not c.busy]
    for conn in idle:
      _close_socket(conn.sock)
    self._path.admission.wait_idle(grace_s)
    with self._lock:
      remaining = list(self._conns)
    for conn in remaining:
      _shutdown(conn.sock)
    self._pool.shutdown(wait=False)


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


def _close_socket(sock: socket.socket) -> None:
  try:
    sock.close()
  except OSError:  # the descriptor is released all the same
    pass
