"""The health service of one worker, on its gRPC port, and what it reports.

Probes belong on the health port (server/serving/health_port.py), which no
load on this port reaches. This service stays for clients that ask here:
with `--auth-token-file`, only for those with the token, like every call on
this port (server/serving/grpc_service.py), since a connection that makes no
call with it is closed soon after it opens (server/serving/front_door.py).
It costs what a peer can make it cost, bounded per peer address:

  * Check and List wait for their request message on threads of their own
    (`HEALTH_THREADS`, apart from the request threads), under the arrival
    deadline (server/serving/grpc_service.py); a peer may keep at most
    MAX_WAITING_PER_PEER of them waiting at once, more are refused at once,
    so header-only calls from one address cannot queue everyone else's
    Check behind them;
  * Watch waits for its request on threads of its own, as many per peer,
    and holds none once it came (gRPC's non-blocking streams): a peer keeps
    at most MAX_WATCHES_PER_PEER open, a worker MAX_WATCHES; and one
    without the server's token (a server without one) ends after the idle
    timeout (`--idle-timeout-s`, status OK: open another), so that a Watch
    cannot keep its connection from going idle and being closed.

SERVING means the worker can serve a Describe now: `Health` turns NOT_SERVING
while the worker's crash-loop flag is on (server/process/restarts.py) or while its
request threads cannot start a task within PROBE_TIMEOUT_S (every one held:
Kubernetes then takes the replica out of rotation instead of sending it
clients it cannot answer). A `WorkerSlot` (server/process/health_board.py)
hears the same, with a heartbeat, for the health port.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator, Protocol

import grpc
from grpc_health.v1 import health_pb2 as pb

from grain_elevator.server.serving.options import HEALTH_THREADS
from grain_elevator.server.serving.grpc_service import first_request

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = pb.HealthCheckResponse.SERVING
NOT_SERVING = pb.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = pb.HealthCheckResponse.SERVICE_UNKNOWN
# A Describe is a few microseconds of work: a thread pool that cannot start
# one within this long is held by something else. Several arrival deadlines
# (grpc_service.REQUEST_ARRIVAL_TIMEOUT_S), so a burst of header-only calls,
# which the deadline clears in about one, does not flap the status.
PROBE_TIMEOUT_S = 5.0
PROBE_PERIOD_S = 0.5
# Health calls of one peer address waiting for their request message: a
# probe's message follows its headers at once, so two cover a kubelet's
# readiness and liveness probes arriving together.
MAX_WAITING_PER_PEER = 2
# Watch streams open at once: of one peer address without the token, and of
# every peer together (per worker on the gRPC port).
MAX_WATCHES_PER_PEER = 4
MAX_WATCHES = 256


class WorkerReport(Protocol):
  """Where a worker's health is seen from outside it (health_board.WorkerSlot)."""

  def beat(self) -> None: ...
  def set_held(self, held: bool) -> None: ...


def peer_address(peer: str) -> str:
  """The address part of gRPC's `context.peer()`: "ipv4:10.0.0.7:5123" is
  "10.0.0.7", "ipv6:[::1]:5123" is "::1"; anything else as it is."""
  kind, _, rest = peer.partition(":")
  if kind == "ipv4":
    return rest.rpartition(":")[0]
  if kind == "ipv6":
    return rest.rpartition(":")[0].strip("[]")
  return peer


class PeerCounts:
  """How many of something each peer address holds, each at most `limit`.
  Thread-safe; a peer holding none is forgotten."""

  def __init__(self, limit: int):
    self.limit = limit
    self._lock = threading.Lock()
    self._held: dict[str, int] = {}

  def take(self, peer: str) -> bool:
    """One more for `peer`, unless it holds `limit` already."""
    with self._lock:
      held = self._held.get(peer, 0)
      if held >= self.limit:
        return False
      self._held[peer] = held + 1
      return True

  def give(self, peer: str) -> None:
    with self._lock:
      held = self._held.get(peer, 0) - 1
      if held > 0:
        self._held[peer] = held
      else:
        self._held.pop(peer, None)


@dataclasses.dataclass(eq=False)
class _Watch:
  """One open Watch stream; `send` is gRPC's non-blocking response callback."""
  service: str
  peer: str | None  # counted against its peer's MAX_WATCHES_PER_PEER; None: has the token
  until: float  # when it ends (inf: never)
  send: Callable[[Any], None]
  context: grpc.ServicerContext
  sent: int | None = None  # the status last sent


class Health:
  """The worker's health status, and the gRPC service that reports it.

  `watch_s`: how long a Watch without the token lasts (the idle timeout);
  `trusted(context)`: whether a call carries the server's token (with a
  token set, every call that reaches the service does);
  `report`: where the status is seen from outside (the health port)."""

  def __init__(self, services: tuple[str, ...], *, watch_s: float = math.inf,
               trusted: Callable[[grpc.ServicerContext], bool] = lambda _: False,
               report: WorkerReport | None = None):
    self._services = services
    self._watch_s = watch_s
    self._trusted = trusted
    self._report = report
    # Calls waiting for their message, per peer: Check and List apart from
    # Watch, so that a flood of Watch calls does not refuse its peer's Checks.
    self._waiting = {False: PeerCounts(MAX_WAITING_PER_PEER),
                     True: PeerCounts(MAX_WAITING_PER_PEER)}
    self._watchers = PeerCounts(MAX_WATCHES_PER_PEER)
    self._stop = threading.Event()
    self._lock = threading.Lock()  # guards everything below
    self._reasons: set[str] = set()
    self._status = NOT_SERVING  # until `publish`
    self._stopped = False
    self._watches: dict[int, _Watch] = {}
    self._ids = itertools.count()
    self._changed = threading.Condition(self._lock)  # the status, or a watch added
    threading.Thread(target=self._tend_watches, name="elevator-health-watch",
                     daemon=True).start()

  # -- status ----------------------------------------------------------------

  def status(self, service: str = "") -> int | None:
    """The status of `service` (None: not one this worker serves)."""
    if service not in self._services:
      return None
    with self._lock:
      return self._status

  def publish(self) -> None:
    """Sets the status from the reasons now on."""
    with self._lock:
      status = NOT_SERVING if self._reasons or self._stopped else SERVING
      if status != self._status:
        self._status = status
        self._changed.notify_all()

  def set_reason(self, reason: str, on: bool) -> None:
    """NOT_SERVING while any reason is on ("crash loop", "threads")."""
    with self._lock:
      (self._reasons.add if on else self._reasons.discard)(reason)
    if reason == "threads" and self._report is not None:
      self._report.set_held(on)
    self.publish()

  def watch_pool(self, pool: futures.ThreadPoolExecutor) -> None:
    """From a daemon thread: NOT_SERVING while `pool` cannot start a task
    within PROBE_TIMEOUT_S; the report's heartbeat every PROBE_PERIOD_S."""
    beat = self._report.beat if self._report is not None else lambda: None

    def probe() -> None:
      while True:
        beat()
        if self._stop.wait(PROBE_PERIOD_S):
          return
        started = threading.Event()
        try:
          pool.submit(started.set)
        except RuntimeError:  # shut down
          return
        due, held = time.monotonic() + PROBE_TIMEOUT_S, False
        while not started.wait(PROBE_PERIOD_S):  # until a thread takes it
          beat()
          if self._stop.is_set():
            return
          if not held and time.monotonic() >= due:
            self.set_reason("threads", True)
            held = True
        if held:
          self.set_reason("threads", False)
    threading.Thread(target=probe, name="elevator-health-probe", daemon=True).start()

  def stop(self) -> None:
    """NOT_SERVING for good (graceful shutdown)."""
    self._stop.set()
    with self._lock:
      self._stopped = True
    self.publish()

  # -- the gRPC service ------------------------------------------------------

  def add_to_server(self, server: grpc.Server) -> None:
    check_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health")
    watch_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health-watch")

    def unary(method: Callable[[Any, grpc.ServicerContext], Any], request: Any) -> Any:
      def call(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        message = self._first(requests, context, request, watch=False)
        return request() if message is None else method(message, context)
      call.experimental_thread_pool = check_pool  # type: ignore[attr-defined]
      return call

    def watch(requests: Iterator[bytes], context: grpc.ServicerContext,
              send: Callable[[Any], None]) -> None:
      message = self._first(requests, context, pb.HealthCheckRequest, watch=True)
      if message is not None:
        self._watch(message, context, send)
      else:
        send(None)
    watch.experimental_thread_pool = watch_pool  # type: ignore[attr-defined]
    watch.experimental_non_blocking = True  # type: ignore[attr-defined]

    serialize = pb.HealthCheckResponse.SerializeToString
    handlers = {
        "Check": grpc.stream_unary_rpc_method_handler(
            unary(self._check, pb.HealthCheckRequest), response_serializer=serialize),
        "List": grpc.stream_unary_rpc_method_handler(
            unary(self._list, pb.HealthListRequest),
            response_serializer=pb.HealthListResponse.SerializeToString),
        "Watch": grpc.stream_stream_rpc_method_handler(watch, response_serializer=serialize),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

  def _first(self, requests: Iterator[bytes], context: grpc.ServicerContext,
             message: Any, *, watch: bool) -> Any:
    """The call's request message; None if it never came. Refused at once
    (RESOURCE_EXHAUSTED) if its peer has MAX_WAITING_PER_PEER calls of its
    kind (Watch; Check or List) waiting for theirs already."""
    peer, waiting = peer_address(context.peer()), self._waiting[watch]
    if not waiting.take(peer):
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_WAITING_PER_PEER} health calls of {peer} are waiting for "
                    "their request message already")
    try:
      return first_request(requests, context, message)
    finally:
      waiting.give(peer)

  def _check(self, request: pb.HealthCheckRequest,
             context: grpc.ServicerContext) -> pb.HealthCheckResponse:
    status = self.status(request.service)
    if status is None:
      context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
    return pb.HealthCheckResponse(status=status)

  def _list(self, request: pb.HealthListRequest,
            context: grpc.ServicerContext) -> pb.HealthListResponse:
    del request, context
    with self._lock:
      status = self._status
    return pb.HealthListResponse(
        statuses={s: pb.HealthCheckResponse(status=status) for s in self._services})

  def _watch(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext,
             send: Callable[[Any], None]) -> None:
    """Registers a Watch, refused past the peer's or the worker's limit;
    `_tend_watches` sends it what changes and ends it."""
    peer: str | None = None
    until = math.inf
    if not self._trusted(context):
      peer, until = peer_address(context.peer()), time.monotonic() + self._watch_s
      if not self._watchers.take(peer):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{MAX_WATCHES_PER_PEER} health Watch streams of {peer} are open "
                      "already")
    w = _Watch(request.service, peer, until, send, context)
    key = next(self._ids)
    with self._lock:
      full = len(self._watches) >= MAX_WATCHES
      if not full:
        self._watches[key] = w
        self._changed.notify_all()
    if full:
      self._forget(w)
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_WATCHES} health Watch streams are open on this worker")
    if not context.add_callback(lambda: self._drop(key)):
      self._drop(key)  # over already

  def _drop(self, key: int) -> None:
    with self._lock:
      w = self._watches.pop(key, None)
    if w is not None:
      self._forget(w)

  def _forget(self, w: _Watch) -> None:
    if w.peer is not None:
      self._watchers.give(w.peer)

  def _tend_watches(self) -> None:
    """Sends each Watch its status when it changes (the first at once), and
    ends those past their time; sends outside the lock."""
    while True:
      with self._lock:
        now = time.monotonic()
        status = self._status
        ended = [(k, w) for k, w in self._watches.items() if w.until <= now]
        for k, _ in ended:
          del self._watches[k]
        due = [w for w in self._watches.values()
               if w.sent != self._status_for(w.service, status)]
        for w in due:
          w.sent = self._status_for(w.service, status)
        next_end = min((w.until for w in self._watches.values()), default=math.inf)
        if not ended and not due:
          self._changed.wait(min(1.0, max(0.0, next_end - now)))
          continue
      for w in due:
        _quietly(w.send, pb.HealthCheckResponse(status=w.sent))
      for _, w in ended:
        self._forget(w)
        _quietly(w.context.set_details, "a Watch without the token lasts "
                 "--idle-timeout-s; open another")
        _quietly(w.send, None)  # the stream ends, status OK

  def _status_for(self, service: str, status: int) -> int:
    return status if service in self._services else SERVICE_UNKNOWN


def _quietly(send: Callable[[Any], Any], what: Any) -> None:
  """`send(what)` on a stream that may have ended meanwhile."""
  try:
    send(what)
  except Exception:  # pylint: disable=broad-except
    pass  # its client went away: the stream's callback drops it
