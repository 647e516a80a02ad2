"""The client's request path: connections to every replica, and fetching
steps with failover.

A replica's worker processes share one port and the kernel hands each new
TCP connection to one of them by a hash, so a handful of connections can
easily all land on one worker. On first contact the pool opens the
connections that will carry batches until each worker of each replica
holds an equal share (the bulk handshake, or Describe over gRPC, says which
worker answered), and closes the surplus. Batches travel over the bulk
transport where a replica offers it and it can be reached (`auto`), else
over gRPC; one gRPC channel per target answers Describe.

Every message size is bounded before allocation. gRPC fixes a channel's
limits when the channel is made, so the pool first contacts each target
with channels that take no batch over the control limit (transport.py),
learns the element spec, and only then opens the connections that carry
batches: gRPC channels limited to a whole global batch of the dataset and
G it is first asked about (`_open_data`; reopened larger should a later
request need more). Each step is then checked exactly: its size, and its
leaves against the spec. A replica that breaks either is shunned and the
remaining steps are asked of another (`fetch`); DataLossError only once
every replica has.

Every request goes through `_retrying`: a retriable failure (options.py's
RETRIABLE) shuns the connection's replica and sends the remaining steps to
the next connection after a backoff, both from `RetryPolicy`; steps already
received are kept, so each step reaches the trainer exactly once, in order,
whichever replica served it. RESOURCE_EXHAUSTED says the replica is full
right now: the retry goes to another replica, else over the other transport
(gRPC, if the request came over bulk), else to the same one after the
backoff; one rate-limited warning says so (`_after_full`). UNAUTHENTICATED
and PERMISSION_DENIED (options.py's REFUSED) are never retried.

Bulk connections are plain sockets, so nothing re-resolves a
"dns:///name:port" target for them: the pool asks DNS again before each
reconnect and every `TransportOptions.dns_refresh_s` (`_refresh`). An
address new behind the name gets connections; one that left is retired
after its current request, so a rolling update of a headless Service moves
the trainer to the new pods.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import grpc
import numpy as np

from grain_elevator.client.buffers import BufferPool
from grain_elevator.client.bulk import BulkConnection
from grain_elevator.client.options import (REFUSED, RETRIABLE, RetryPolicy, Security,
                                           TransportOptions)
from grain_elevator.client.transport import (MAX_CONTROL_MESSAGE_BYTES, BadReplyError,
                                             CancelToken, Connection, GrpcConnection,
                                             TransportError)
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto.errors import InvalidRequestError
from grain_elevator.proto.spec import DatasetInfo, LeafSpec
from grain_elevator.proto.throttle import Throttled

log = logging.getLogger("grain_elevator.client")
T = TypeVar("T")

# A full (or lying) replica fails requests by the hundred: one warning per period.
_FULL_LOG_PERIOD_S = 10.0
# Reconnects come in bursts (every connection to a pod that left breaks at
# once): DNS is asked at most this often.
_MIN_RESOLVE_GAP_S = 0.5

_URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "local:")


def parse_targets(target: str | Sequence[str]) -> list[str]:
  """Validates "host:port" targets (or gRPC URIs such as dns:///name:port)."""
  targets = [target] if isinstance(target, str) else list(target)
  if not targets:
    raise InvalidRequestError(f"target must be 'host:port' or a list of them, got {target!r}")
  for t in targets:
    if not isinstance(t, str):
      raise InvalidRequestError(f"target must be 'host:port' or a list of them, got {target!r}")
    if t.startswith(_URI_SCHEMES):
      continue
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise InvalidRequestError(f"target {t!r} is not 'host:port' (e.g. 'localhost:50051')")
  return targets


def _bulk_hosts(target: str) -> list[str]:
  """The replica addresses behind a target, for bulk connections: the host of
  "host:port"; every address a "dns:///name:port" name resolves to now (a
  headless Service); none for other gRPC URIs (those use gRPC)."""
  if target.startswith("dns:"):
    name = target[len("dns:"):].lstrip("/").rpartition("/")[2]
    host = name.rpartition(":")[0] or name
    try:
      infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
      return []
    return sorted({info[4][0] for info in infos})
  if target.startswith(_URI_SCHEMES):
    return []
  host = target.rpartition(":")[0]
  return [host[1:-1] if host.startswith("[") else host]


def _replica_name(replica: tuple[str, str] | None) -> str:
  """How a warning names a replica: its target, and its address if the
  target is a name for several."""
  if replica is None:
    return "a replica"
  target, host = replica
  return target if host in (target, target.rpartition(":")[0].strip("[]")) else (
      f"{host} (behind {target})")


@dataclasses.dataclass(eq=False)
class Slot:
  """A connection's place in the pool: reopened after it broke, shunned
  (with the rest of its replica) after failures, retired once its address
  left DNS."""

  conn: Connection
  in_use: int = 0
  failures: int = 0
  shunned_until: float = 0.0
  served: int = 0  # steps received over it (and the connections it replaced)
  retired: bool = False  # closed and dropped when its request ends

  @property
  def replica(self) -> tuple[str, str]:
    return self.conn.target, self.conn.host


class Slots:
  """Connections shared by fetch threads: each request checks one out (a
  bulk connection carries one request at a time, so they also bound the
  requests in flight) and returns it saying whether it failed."""

  def __init__(self, slots: list[Slot], retry: RetryPolicy):
    self._slots = slots
    self._retry = retry
    self._free = threading.Condition()
    self._next = itertools.count()
    self._closed = False

  def __bool__(self) -> bool:
    return bool(self._slots)

  def __iter__(self):
    return iter(list(self._slots))

  def checkout(self, cancelled: Callable[[], bool], route: int | None = None) -> Slot | None:
    """A slot with room (None once cancelled or closed), preferring replicas
    not failing lately: waits for a healthy one rather than take a failing
    one, unless all fail. `route` (a chunk number): a slot of the worker
    that owns it (`owner_of`), waiting for one of its slots to be free,
    unless that worker has none or its replica is failing; else round-robin."""
    with self._free:
      while True:
        if cancelled() or self._closed:
          return None
        now = time.monotonic()
        live = [s for s in self._slots if not s.retired]
        owners = owner_of(live, route) if route is not None else []
        if owners and all(s.shunned_until <= now for s in owners):
          free = [s for s in owners if s.in_use < s.conn.capacity]
        else:
          healthy = [s for s in live if s.shunned_until <= now]
          free = [s for s in (healthy or live) if s.in_use < s.conn.capacity]
        if free:
          chosen = free[next(self._next) % len(free)]
          chosen.in_use += 1
          return chosen
        self._free.wait(0.1)

  def release(self, slot: Slot, *, failed: bool, lied: bool = False) -> None:
    """Returns `slot`. A failure shuns its whole replica (RetryPolicy.shun_s):
    its other connections would most likely each cost a timeout to find the
    same. A replica that `lied` (sent a batch breaking the spec) is shunned
    for shun_max_s: its next answer is unlikely to be better."""
    with self._free:
      if failed or lied:
        slot.failures += 1
        until = time.monotonic() + (self._retry.shun_max_s if lied
                                    else self._retry.shun_s(slot.failures))
        for other in self._slots:
          if other.replica == slot.replica:
            other.shunned_until = max(other.shunned_until, until)
      else:
        slot.failures = 0
      slot.in_use -= 1
      if slot.retired:
        self._drop_retired()
      self._free.notify()

  def has_room_elsewhere(self, replica: tuple[str, str] | None) -> bool:
    """Whether a replica other than `replica` is not shunned (its slots may
    be busy: checkout waits for them)."""
    now = time.monotonic()
    with self._free:
      return any(s.replica != replica and not s.retired and s.shunned_until <= now
                 for s in self._slots)

  def add(self, slots: list[Slot]) -> None:
    with self._free:
      if self._closed:
        for slot in slots:
          slot.conn.close()
        return
      self._slots.extend(slots)
      self._free.notify_all()

  def retire(self, which: Callable[[Slot], bool]) -> None:
    """Takes the slots `which` picks out of service: closed now if idle,
    else once their request ends."""
    with self._free:
      for slot in self._slots:
        if which(slot):
          slot.retired = True
      self._drop_retired()

  def _drop_retired(self) -> None:
    done = [s for s in self._slots if s.retired and not s.in_use]
    for slot in done:
      slot.conn.close()
    self._slots = [s for s in self._slots if s not in done]

  def close(self) -> None:
    with self._free:
      self._closed = True
      for slot in self._slots:
        slot.conn.close()
      self._free.notify_all()


def owner_of(slots: Sequence[Slot], chunk: int) -> list[Slot]:
  """The slots to the worker that owns `chunk`, a function of the chunk and
  the replicas alone, so every trainer sends the same chunk to the same
  worker, whose cache then serves it to all (server/batch_cache.py).
  Chunk c goes to replica c mod R of the replicas sorted by address, and
  there to worker (c // R) mod W: consecutive chunks spread over all."""
  replicas = sorted({s.replica for s in slots})
  if not replicas:
    return []
  replica = replicas[chunk % len(replicas)]
  mine = [s for s in slots if s.replica == replica and getattr(s.conn, "server", None)]
  workers = max((s.conn.server.num_workers for s in mine), default=0)
  if not workers:
    return []
  worker = chunk // len(replicas) % workers
  return [s for s in mine if s.conn.server.worker_index == worker]


def _spread_over_workers(open_one: Callable[[], Any | None], per_target: int) -> list[list[Any]]:
  """Connections to one replica, grouped by the worker process that took each.

  Opens connections (each knows its worker, `conn.server`) until every
  worker holds ceil(per_target / workers), closing the surplus. Stops early
  when `open_one` fails (returns None).
  """
  by_worker: dict[int, list[Any]] = collections.defaultdict(list)
  for _ in range(8 * max(per_target, 4)):
    conn = open_one()
    if conn is None:
      break
    workers = max(1, conn.server.num_workers)
    want = -(-per_target // workers)  # per worker, at least 1
    group = by_worker[conn.server.worker_index]
    if len(group) < want:
      group.append(conn)
    else:
      conn.close()
    if len(by_worker) >= workers and all(len(g) >= want for g in by_worker.values()):
      break
  return list(by_worker.values())


def _interleave(groups: list[list[Any]]) -> list[Any]:
  """Workers' and replicas' connections taken in turn, so consecutive
  requests spread out."""
  return [c for layer in itertools.zip_longest(*groups) for c in layer if c]


class ConnectionPool:
  """Connections to every replica; describes datasets and fetches steps with
  failover."""

  def __init__(self, targets: Sequence[str], *,
               transport: TransportOptions = TransportOptions(),
               retry: RetryPolicy = RetryPolicy(), security: Security = Security()):
    transport.check_security(security)
    self.targets = list(targets)
    self.transport = transport
    self.retry = retry
    self._security = security
    self._lock = threading.Lock()
    self._contacted = False
    self._closed = False
    # One gRPC channel per target: Describe, and under bulk the requests
    # that fall back to gRPC (`_after_full`).
    self._control = Slots([], retry)
    self._data = Slots([], retry)  # what carries the batches
    # The gRPC limit on batches of the channels that may carry them; 0
    # until they are opened (`_open_data`).
    self._batch_cap = 0
    self._bulk_ports: dict[str, int] = {}
    self._infos: dict[str, DatasetInfo] = {}
    self._refresh_lock = threading.Lock()
    self._resolved_at: dict[str, float] = {}
    self._next_refresh = 0.0
    self._full_log = Throttled(_FULL_LOG_PERIOD_S, log)
    self._lie_log = Throttled(_FULL_LOG_PERIOD_S, log)
    # One pool for all bulk connections: the buffer the trainer dropped last
    # is the one still in cache, whichever connection reads next.
    self._buffers = BufferPool()
    self.uses_bulk = False
    self.retries = 0  # attempts tried again (client/stats.py)
    self.fallbacks = 0  # bulk requests moved to gRPC, bulk ports given up for gRPC

  # -- opening ---------------------------------------------------------------

  def _contact(self, target: str, max_batch_bytes: int = MAX_CONTROL_MESSAGE_BYTES
               ) -> GrpcConnection | None:
    """A new channel to `target` that answered Describe (which says its
    worker and bulk port); None when down. A replica that is full
    (RESOURCE_EXHAUSTED) is asked again within `connect_timeout_s`: it is
    up, and giving up would cost it its bulk connections. A refusal
    (REFUSED: a wrong token) raises its typed error: no transport would fare
    better."""
    conn = GrpcConnection(target, self._security, max_batch_bytes)

    def ask(_: Slots | None) -> pb.DescribeResponse:
      try:
        return conn.describe(pb.DescribeRequest(), timeout_s=self.retry.connect_timeout_s)
      except TransportError as e:
        e.replica = (target, target)
        raise

    try:
      response = self._retrying(lambda: f"Describe at {target}", ask, None,
                                timeout_s=self.retry.connect_timeout_s,
                                retriable=frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}))
    except errors.ElevatorError as e:
      conn.close()
      if e.code in REFUSED:
        raise
      return None
    self._bulk_ports[target] = response.server.bulk_port
    return conn

  def _open_bulk(self, target: str, host: str, port: int) -> BulkConnection:
    return BulkConnection(target, host, port, connect_timeout_s=self.retry.connect_timeout_s,
                          auth_token=self._security.auth_token, buffers=self._buffers)

  def _spread_grpc(self, target: str, max_batch_bytes: int) -> list[list[Any]]:
    groups = _spread_over_workers(lambda: self._contact(target, max_batch_bytes),
                                  self.transport.connections_per_target)
    if not groups:  # unreachable now: plain channels that connect later
      return [[GrpcConnection(target, self._security, max_batch_bytes)]
              for _ in range(self.transport.connections_per_target)]
    return groups

  def _spread_bulk_host(self, target: str, host: str,
                        dial: Callable[[str, str], BulkConnection]
                        ) -> tuple[list[list[Any]], TransportError | None]:
    """Bulk connections to the replica at `host`, balanced over its workers,
    and why none could be opened."""
    failures: list[TransportError] = []

    def open_one() -> BulkConnection | None:
      try:
        return dial(target, host)
      except TransportError as e:
        failures.append(e)
        return None

    found = _spread_over_workers(open_one, self.transport.connections_per_target)
    return found, (failures[-1] if failures and not found else None)

  def _spread_bulk(self, target: str) -> list[list[Any]]:
    """Bulk connections to each replica behind `target`, balanced over its
    workers; none where a replica offers no bulk port or it cannot be
    reached (gRPC then)."""
    port = self._bulk_ports.get(target, 0)
    groups: list[list[Any]] = []
    for host in _bulk_hosts(target) if port else []:
      found, failure = self._spread_bulk_host(
          target, host, lambda t, h: self._open_bulk(t, h, port))
      if failure:
        self.fallbacks += 1
        why = ("answered, but not as an elevator bulk port" if "handshake failed"
               in failure.details else "cannot be reached from here")
        log.warning("%s: bulk port %s:%d %s (%s); using gRPC, which costs more CPU per "
                    "byte. Open that port between trainer and server (fix it with "
                    "`elevator serve --bulk-port`), or pass TransportOptions(kind='grpc')",
                    target, host, port, why, failure.details)
      groups += found
    self._resolved_at[target] = time.monotonic()
    return groups

  def _open_control(self) -> None:
    """Contacts every target, once: the channels that answered (with the
    control limit: no element spec is known yet) carry Describe."""
    if self._contacted:
      return
    with self._lock:
      if self._contacted or self._closed:
        return
      first: list[GrpcConnection | None] = []
      try:
        for target in self.targets:
          first.append(self._contact(target))
      except errors.ElevatorError:
        for conn in first:
          if conn:
            conn.close()
        raise
      self._control.add([Slot(c or GrpcConnection(t, self._security))
                         for t, c in zip(self.targets, first)])
      self._contacted = True

  def _open_data(self, max_batch_bytes: int) -> None:
    """Opens the connections that carry batches, gRPC channels among them
    accepting batches up to `max_batch_bytes` (from the element spec);
    opened again, and the old ones retired, when a request needs more than
    they were opened with."""
    if self._batch_cap >= max_batch_bytes:
      return
    with self._lock:
      if self._closed or self._batch_cap >= max_batch_bytes:
        return
      first_time = not self._batch_cap
      data: list[Any] = []
      if first_time and self.transport.kind != "grpc" and not self._security.tls:
        data = _interleave([g for t in self.targets for g in self._spread_bulk(t)])
        if self.transport.kind == "bulk" and not data:
          raise errors.ServiceUnavailableError(
              f"transport kind 'bulk', but no replica of {', '.join(self.targets)} offers "
              "a reachable bulk port (is it started with --no-bulk or TLS?)")
        self.uses_bulk = bool(data)
      if self.uses_bulk:  # gRPC carries only the requests falling back: the control channels
        old = list(self._control)
        self._control.add([Slot(GrpcConnection(t, self._security, max_batch_bytes))
                           for t in self.targets])
        self._control.retire(lambda s: s in old)
      else:  # gRPC carries the batches: balance its channels
        old = list(self._data)
        data = _interleave([g for t in self.targets
                            for g in self._spread_grpc(t, max_batch_bytes)])
      self._data.add([Slot(c) for c in data])
      if not self.uses_bulk:
        self._data.retire(lambda s: s in old)
      if first_time:
        self._next_refresh = time.monotonic() + self.transport.dns_refresh_s
      self._batch_cap = max_batch_bytes

  @property
  def num_connections(self) -> int:
    """gRPC channels open (the control ones and any carrying batches)."""
    conns = {id(s.conn): s.conn for s in [*self._control, *self._data]}
    return sum(isinstance(c, GrpcConnection) for c in conns.values())

  def data_slots(self) -> list[Slot]:
    """The connections that carry batches (for tests and diagnostics)."""
    return list(self._data)

  def close(self) -> None:
    with self._lock:
      self._closed = True
    self._data.close()
    self._control.close()

  # -- following DNS (bulk only: gRPC channels re-resolve by themselves) -------

  def _refresh_if_due(self) -> None:
    """Asks DNS again every `dns_refresh_s`, so connections follow a
    headless Service's pods as they come and go."""
    now = time.monotonic()
    if not self.uses_bulk or now < self._next_refresh:
      return
    self._next_refresh = now + self.transport.dns_refresh_s
    for target in self.targets:
      self._refresh(target, wait=False)

  def _refresh(self, target: str, *, wait: bool) -> None:
    """Makes the bulk connections of a "dns:" target follow what its name
    resolves to now: connections to each new address, and the slots of
    addresses no longer there retired. An empty answer, or new addresses
    that cannot be reached while the old are all gone, change nothing: the
    old ones are then retried (and DNS asked again at their reconnect).
    `wait`: wait for a refresh running in another thread (else skip)."""
    if not (self.uses_bulk and target.startswith("dns:") and self._bulk_ports.get(target)):
      return
    if not self._refresh_lock.acquire(blocking=wait):
      return
    try:
      now = time.monotonic()
      if self._closed or now - self._resolved_at.get(target, -1e9) < _MIN_RESOLVE_GAP_S:
        return
      self._resolved_at[target] = now
      hosts = _bulk_hosts(target)
      if not hosts:
        return
      have = {s.conn.host for s in self._data if s.conn.target == target and not s.retired}
      gone = have - set(hosts)
      groups: list[list[Any]] = []
      for host in (h for h in hosts if h not in have):
        found, failure = self._spread_bulk_host(target, host, self._dial)
        if failure:
          log.info("%s: new address %s not reachable yet (%s)", target, host, failure.details)
        groups += found
      if groups:
        self._data.add([Slot(c) for c in _interleave(groups)])
      if gone and (groups or have - gone):
        self._data.retire(lambda s: s.conn.target == target and s.conn.host in gone)
      if groups or gone:
        log.info("%s now resolves to %s: %d bulk connections opened, %s retired", target,
                 ", ".join(hosts), sum(map(len, groups)), ", ".join(sorted(gone)) or "none")
    finally:
      self._refresh_lock.release()

  # -- the request path ------------------------------------------------------

  def _retrying(self, what: Callable[[], str], attempt: Callable[[Slots | None], T],
                slots: Slots | None, *,
                cancelled: Callable[[], bool] = lambda: False,
                progress: Callable[[], int] = lambda: 0,
                timeout_s: float | None = None,
                retriable: frozenset[grpc.StatusCode] = RETRIABLE) -> T:
    """`attempt(slots)` until it returns, with backoff; a retriable
    TransportError (or a BadReplyError, where `slots` hold other replicas
    that may answer right) is tried again until `timeout_s` (the policy's
    by default) passes without `progress()` growing, any other one raises
    its typed error. After RESOURCE_EXHAUSTED the next attempt may be given
    other slots (`_after_full`)."""
    timeout_s = timeout_s or self.retry.timeout_s
    deadline = time.monotonic() + timeout_s
    last: TransportError | None = None
    tries = 0
    use = slots
    while True:
      before = progress()
      try:
        return attempt(use)
      except TransportError as e:
        if cancelled() or self._closed:
          raise errors.Cancelled(f"{what()}: cancelled") from e
        if e.code not in retriable and not (isinstance(e, BadReplyError) and slots):
          raise e.to_error() from e
        last = e
        if progress() > before:  # steps arrived: a fresh window
          deadline = time.monotonic() + timeout_s
          tries = 0
        use = slots
        self.retries += 1
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
          use = self._after_full(e, slots, what)
      if time.monotonic() >= deadline:
        raise errors.ServiceUnavailableError(
            f"no replica of {', '.join(self.targets)} could serve {what()} within "
            f"{timeout_s:.0f}s (last error: {last.code.name}: {last.details})")
      cap = self.retry.backoff_cap(tries)
      time.sleep(random.uniform(cap / 2, cap))
      tries += 1
      if cancelled():
        raise errors.Cancelled(f"{what()}: cancelled")

  def _after_full(self, e: TransportError, slots: Slots | None,
                  what: Callable[[], str]) -> Slots | None:
    """Where to retry after a replica answered RESOURCE_EXHAUSTED (full right
    now; `_with_slot` has shunned it): another replica if one has room, else
    gRPC if it came over bulk (`auto` only: `bulk` was asked for), else the
    same slots once the backoff has passed. Says so in a warning."""
    fallback = not e.over_bulk and slots is self._data and self.uses_bulk
    if slots is None:
      use, move = None, "asking again"
    elif fallback:  # it was the gRPC retry of a bulk request
      use, move = slots, "no replica has room over either transport: retrying after a backoff"
    elif slots.has_room_elsewhere(e.replica):
      use, move = slots, "retrying on another replica"
    elif e.over_bulk and slots is self._data and self.transport.kind == "auto":
      use, move = self._control, "no other replica has room: retrying over gRPC"
      self.fallbacks += 1
    else:
      use, move = slots, "no other replica has room: retrying after a backoff"
    replica = _replica_name(e.replica)
    self._full_log.warning((replica, move), "%s is full (RESOURCE_EXHAUSTED: %s); %s (%s)",
                           replica, e.details, move, what())
    return use

  def _with_slot(self, slots: Slots, use: Callable[[Slot], T],
                 cancelled: Callable[[], bool] = lambda: False,
                 route: int | None = None) -> T:
    """`use(slot)` on a checked-out slot (of the worker owning chunk
    `route`, if given), reopened first if it broke; a retriable failure
    or a bad reply shuns the slot's replica. A TransportError leaves saying
    where it happened."""
    slot = slots.checkout(lambda: cancelled() or self._closed, route)
    if slot is None:
      raise TransportError(grpc.StatusCode.CANCELLED, "cancelled")
    failed = lied = False
    try:
      if slot.conn.broken:
        self._reconnect(slot)
      return use(slot)
    except TransportError as e:
      failed = e.code in RETRIABLE and not cancelled()  # our own cancel is no failure
      lied = isinstance(e, BadReplyError)
      e.replica, e.over_bulk = slot.replica, isinstance(slot.conn, BulkConnection)
      raise
    finally:
      slots.release(slot, failed=failed, lied=lied)

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    """What the servers offer. Given a global batch size, also opens the
    connections that will carry its batches (sized from the spec)."""
    self._open_control()
    request = pb.DescribeRequest(dataset=dataset, global_batch_size=global_batch_size)
    response = self._retrying(
        lambda: f"Describe({dataset!r})",
        lambda slots: self._with_slot(slots, lambda s: s.conn.describe(
            request, timeout_s=self.retry.request_timeout_s)),
        self._control)
    infos = [DatasetInfo.from_proto(d) for d in response.datasets]
    self._infos.update((i.name, i) for i in infos)
    if global_batch_size > 0 and infos:
      self._open_data(max(i.element_spec.max_batch_bytes(global_batch_size) for i in infos))
    return infos

  def fetch(self, request: pb.BatchRequest, token: CancelToken,
            out: list[list[np.ndarray]] | None = None) -> list[list[np.ndarray]]:
    """Steps [start, start+num) of `request`, in order, from any replica.

    Each step is appended to `out` (a new list by default) as it arrives, so
    a caller may take early steps before the request ends. The request goes
    to the worker owning its chunk (`owner_of`); the iterator cuts requests
    at multiples of their size, so start_step // num_steps numbers them
    alike for every trainer."""
    self._open_control()
    limit, expect = self._expect(request)
    self._refresh_if_due()
    out = [] if out is None else out
    liars: set[tuple[str, str]] = set()

    def attempt(slots: Slots | None) -> list[list[np.ndarray]]:
      assert slots is not None
      remaining = pb.BatchRequest()
      remaining.CopyFrom(request)
      remaining.start_step = request.start_step + len(out)
      remaining.num_steps = request.num_steps - len(out)

      def stream(slot: Slot) -> None:
        for _, leaves in slot.conn.stream(remaining, timeout_s=self.retry.request_timeout_s,
                                          token=token, max_frame_bytes=limit, expect=expect):
          out.append(leaves)  # the step it must be, checked (transport.decode_step)
          slot.served += 1

      try:
        self._with_slot(slots, stream, lambda: token.cancelled,
                        route=request.start_step // max(1, request.num_steps))
      except BadReplyError as e:
        self._lied(e, liars)
        raise
      except TransportError:
        if len(out) == request.num_steps:  # it failed after its last step: all here
          return out
        raise
      return out

    return self._retrying(
        lambda: f"dataset {request.dataset!r} step {request.start_step + len(out)}",
        attempt, self._data, cancelled=lambda: token.cancelled, progress=lambda: len(out))

  def _expect(self, request: pb.BatchRequest) -> tuple[int, tuple[LeafSpec, ...]]:
    """What each step of `request` must be, from the dataset's element spec:
    the longest message it can take, and its leaves. Opens (or enlarges)
    the connections carrying batches to accept it."""
    info = self._infos.get(request.dataset)
    if info is None:
      (info,) = self.describe(request.dataset)
    spec = info.element_spec
    rows = request.global_batch_size // max(1, request.shard_count)
    limit = spec.max_batch_bytes(rows)
    if self._batch_cap < limit:
      self._open_data(spec.max_batch_bytes(request.global_batch_size))
    return limit, spec.batch_leaves(rows)

  def _lied(self, e: BadReplyError, liars: set[tuple[str, str]]) -> None:
    """Notes that the replica behind `e` sent a bad batch for this request
    (`_with_slot` has shunned it); DataLossError once every replica has."""
    liars.add(e.replica)
    replicas = {s.replica for s in self._data if not s.retired}
    if replicas <= liars:
      raise errors.DataLossError(
          f"{e.details} (every replica of {', '.join(self.targets)} sent a batch that "
          "breaks the element spec or its size bound)") from e
    replica = _replica_name(e.replica)
    self._lie_log.warning(replica, "%s; shunning %s and asking another replica",
                          e.details, replica)

  def _reconnect(self, slot: Slot) -> None:
    """Replaces a broken bulk connection, asking DNS first whether its
    address is still behind the target: one that left is retired, not
    redialled."""
    broken = slot.conn
    broken.close()
    self._refresh(broken.target, wait=True)
    if slot.retired:
      raise TransportError(grpc.StatusCode.UNAVAILABLE,
                           f"{broken.host} is no longer behind {broken.target}")
    slot.conn = self._dial(broken.target, broken.host)

  def _dial(self, target: str, host: str) -> BulkConnection:
    """A new bulk connection to a replica, asking its current bulk port if
    refused: a restarted server may have picked another port."""
    try:
      return self._open_bulk(target, host, self._bulk_ports[target])
    except TransportError as e:
      if not isinstance(e.__cause__, ConnectionRefusedError):
        raise  # up but not answering (frozen): asking again would only wait again
    contact = self._contact(target)
    if contact is None:
      raise TransportError(grpc.StatusCode.UNAVAILABLE, f"replica {target} is unreachable")
    contact.close()
    if not self._bulk_ports[target]:
      raise TransportError(grpc.StatusCode.UNAVAILABLE,
                           f"replica {target} no longer offers the bulk transport")
    return self._open_bulk(target, host, self._bulk_ports[target])
