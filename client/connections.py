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

Every request goes through `_retrying`: a retriable failure (options.py's
RETRIABLE) shuns the connection's replica and sends the remaining steps to
the next connection after a backoff, both from `RetryPolicy`; steps already
received are kept, so each step reaches the trainer exactly once, in order,
whichever replica served it.
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

from grain_elevator.client.bulk import BulkConnection
from grain_elevator.client.options import RETRIABLE, RetryPolicy, Security, TransportOptions
from grain_elevator.client.transport import (CancelToken, Connection, GrpcConnection,
                                             TransportError)
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto.errors import InvalidRequestError
from grain_elevator.proto import wire
from grain_elevator.proto.spec import DatasetInfo

log = logging.getLogger("grain_elevator.client")
T = TypeVar("T")

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


@dataclasses.dataclass(eq=False)
class Slot:
  """A connection's place in the pool: reopened after it broke, shunned
  (with the rest of its replica) after failures."""

  conn: Connection
  in_use: int = 0
  failures: int = 0
  shunned_until: float = 0.0
  served: int = 0  # steps received over it (and the connections it replaced)

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

  def checkout(self, cancelled: Callable[[], bool]) -> Slot | None:
    """A slot with room (None once cancelled or closed), round-robin,
    preferring replicas not failing lately: waits for a healthy one rather
    than take a failing one, unless all fail."""
    with self._free:
      while True:
        if cancelled() or self._closed:
          return None
        now = time.monotonic()
        healthy = [s for s in self._slots if s.shunned_until <= now]
        free = [s for s in (healthy or self._slots) if s.in_use < s.conn.capacity]
        if free:
          chosen = free[next(self._next) % len(free)]
          chosen.in_use += 1
          return chosen
        self._free.wait(0.1)

  def release(self, slot: Slot, *, failed: bool) -> None:
    """Returns `slot`. A failure shuns its whole replica (RetryPolicy.shun_s):
    its other connections would most likely each cost a timeout to find the
    same."""
    with self._free:
      if failed:
        slot.failures += 1
        until = time.monotonic() + self._retry.shun_s(slot.failures)
        for other in self._slots:
          if other.replica == slot.replica:
            other.shunned_until = max(other.shunned_until, until)
      else:
        slot.failures = 0
      slot.in_use -= 1
      self._free.notify()

  def close(self) -> None:
    with self._free:
      self._closed = True
      for slot in self._slots:
        slot.conn.close()
      self._free.notify_all()


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
    self._balanced = False
    self._closed = False
    self._control = Slots([], retry)  # one gRPC channel per target: Describe
    self._data = Slots([], retry)  # what carries the batches
    self._bulk_ports: dict[str, int] = {}
    self._infos: dict[str, DatasetInfo] = {}
    self.uses_bulk = False

  # -- opening ---------------------------------------------------------------

  def _contact(self, target: str) -> GrpcConnection | None:
    """A new channel to `target` that answered Describe (which says its
    worker and bulk port); None when down or refusing."""
    conn = GrpcConnection(target, self._security)
    try:
      response = conn.describe(pb.DescribeRequest(),
                               timeout_s=self.retry.connect_timeout_s)
    except TransportError:
      conn.close()
      return None
    self._bulk_ports[target] = response.server.bulk_port
    return conn

  def _open_bulk(self, target: str, host: str, port: int) -> BulkConnection:
    return BulkConnection(target, host, port, connect_timeout_s=self.retry.connect_timeout_s,
                          auth_token=self._security.auth_token)

  def _spread_grpc(self, target: str, first: GrpcConnection | None) -> list[list[Any]]:
    opened = [first] if first else []
    groups = _spread_over_workers(
        lambda: opened.pop() if opened else self._contact(target),
        self.transport.connections_per_target)
    if not groups:  # unreachable now: plain channels that connect later
      return [[GrpcConnection(target, self._security)]
              for _ in range(self.transport.connections_per_target)]
    return groups

  def _spread_bulk(self, target: str) -> list[list[Any]]:
    """Bulk connections to each replica behind `target`, balanced over its
    workers; none where a replica offers no bulk port or it cannot be
    reached (gRPC then)."""
    port = self._bulk_ports.get(target, 0)
    groups: list[list[Any]] = []
    for host in _bulk_hosts(target) if port else []:
      failures: list[TransportError] = []

      def open_one(host: str = host) -> BulkConnection | None:
        try:
          return self._open_bulk(target, host, port)
        except TransportError as e:
          failures.append(e)
          return None

      found = _spread_over_workers(open_one, self.transport.connections_per_target)
      if not found:
        log.warning("%s: bulk port %s:%d unreachable (%s); using gRPC", target, host,
                    port, failures[-1].details)
      groups += found
    return groups

  def _balance(self) -> None:
    """Opens the pool's connections, once."""
    with self._lock:
      if self._balanced or self._closed:
        return
      first = {t: self._contact(t) for t in self.targets}
      data: list[Any] = []
      if self.transport.kind != "grpc" and not self._security.tls:
        data = _interleave([g for t in self.targets for g in self._spread_bulk(t)])
      if self.transport.kind == "bulk" and not data:
        for conn in first.values():
          if conn:
            conn.close()
        raise errors.ServiceUnavailableError(
            f"transport kind 'bulk', but no replica of {', '.join(self.targets)} offers "
            "a reachable bulk port (is it started with --no-bulk or TLS?)")
      self.uses_bulk = bool(data)
      if data:
        control = [first[t] or GrpcConnection(t, self._security) for t in self.targets]
      else:  # gRPC carries the batches: balance its channels; any one answers Describe
        data = _interleave([g for t in self.targets for g in self._spread_grpc(t, first[t])])
        control = [next(c for c in data if c.target == t) for t in self.targets]
      self._control = Slots([Slot(c) for c in control], self.retry)
      self._data = Slots([Slot(c) for c in data], self.retry)
      self._balanced = True

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

  # -- the request path ------------------------------------------------------

  def _retrying(self, what: Callable[[], str], attempt: Callable[[], T],
                cancelled: Callable[[], bool] = lambda: False,
                progress: Callable[[], int] = lambda: 0) -> T:
    """`attempt()` until it returns, with backoff; a retriable TransportError
    is tried again until `timeout_s` passes without `progress()` growing,
    any other one raises its typed error."""
    deadline = time.monotonic() + self.retry.timeout_s
    last: TransportError | None = None
    tries = 0
    while True:
      before = progress()
      try:
        return attempt()
      except TransportError as e:
        if cancelled() or self._closed:
          raise errors.Cancelled(f"{what()}: cancelled") from e
        if e.code not in RETRIABLE:
          raise e.to_error() from e
        last = e
        if progress() > before:  # steps arrived: a fresh window
          deadline = time.monotonic() + self.retry.timeout_s
          tries = 0
      if time.monotonic() >= deadline:
        raise errors.ServiceUnavailableError(
            f"no replica of {', '.join(self.targets)} could serve {what()} within "
            f"{self.retry.timeout_s:.0f}s (last error: {last.code.name}: {last.details})")
      cap = self.retry.backoff_cap(tries)
      time.sleep(random.uniform(cap / 2, cap))
      tries += 1
      if cancelled():
        raise errors.Cancelled(f"{what()}: cancelled")

  def _with_slot(self, slots: Slots, use: Callable[[Slot], T],
                 cancelled: Callable[[], bool] = lambda: False) -> T:
    """`use(slot)` on a checked-out slot, reopened first if it broke; a
    retriable failure shuns the slot's replica."""
    slot = slots.checkout(lambda: cancelled() or self._closed)
    if slot is None:
      raise TransportError(grpc.StatusCode.CANCELLED, "cancelled")
    failed = False
    try:
      if slot.conn.broken:
        slot.conn.close()
        slot.conn = self._reopen_bulk(slot.conn)
      return use(slot)
    except TransportError as e:
      failed = e.code in RETRIABLE and not cancelled()  # our own cancel is no failure
      raise
    finally:
      slots.release(slot, failed=failed)

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    self._balance()
    request = pb.DescribeRequest(dataset=dataset, global_batch_size=global_batch_size)
    response = self._retrying(
        lambda: f"Describe({dataset!r})",
        lambda: self._with_slot(self._control, lambda s: s.conn.describe(
            request, timeout_s=self.retry.request_timeout_s)))
    infos = [DatasetInfo.from_proto(d) for d in response.datasets]
    self._infos.update((i.name, i) for i in infos)
    return infos

  def fetch(self, request: pb.BatchRequest, token: CancelToken,
            out: list[list[np.ndarray]] | None = None) -> list[list[np.ndarray]]:
    """Steps [start, start+num) of `request`, in order, from any replica.

    Each step is appended to `out` (a new list by default) as it arrives, so
    a caller may take early steps before the request ends."""
    self._balance()
    out = [] if out is None else out
    limit = self._frame_limit(request)

    def attempt() -> list[list[np.ndarray]]:
      remaining = pb.BatchRequest()
      remaining.CopyFrom(request)
      remaining.start_step = request.start_step + len(out)
      remaining.num_steps = request.num_steps - len(out)

      def stream(slot: Slot) -> None:
        for step, leaves in slot.conn.stream(remaining, timeout_s=self.retry.request_timeout_s,
                                             token=token, max_frame_bytes=limit):
          if step != request.start_step + len(out):  # never deliver out of order
            raise errors.ElevatorError(f"{request.dataset!r}: server sent step {step}, "
                                       f"expected {request.start_step + len(out)}")
          out.append(leaves)
          slot.served += 1

      try:
        self._with_slot(self._data, stream, lambda: token.cancelled)
      except TransportError:
        if len(out) == request.num_steps:  # it failed after its last step: all here
          return out
        raise
      return out

    return self._retrying(
        lambda: f"dataset {request.dataset!r} step {request.start_step + len(out)}",
        attempt, lambda: token.cancelled, lambda: len(out))

  def _frame_limit(self, request: pb.BatchRequest) -> int:
    """The longest message a step of `request` can be (refused beyond, before
    it is allocated), from the dataset's element spec."""
    info = self._infos.get(request.dataset)
    if info is None:
      (info,) = self.describe(request.dataset)
    rows = request.global_batch_size // max(1, request.shard_count)
    return wire.max_batch_bytes(rows * info.element_spec.record_bytes,
                                len(info.element_spec.leaves))

  def _reopen_bulk(self, broken: BulkConnection) -> BulkConnection:
    """A new bulk connection to a broken one's replica, asking its current
    bulk port if refused: a restarted server may have picked another port."""
    target, host = broken.target, broken.host
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
