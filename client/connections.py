"""Channels to one or more replicas, and fetching steps with failover.

Several channels per target, each its own TCP connection, so the kernel
spreads them over the server's worker processes. A fetch that fails with a
retriable status moves to the next channel (next replica) with capped,
jittered exponential backoff; steps already received are kept, so each step
reaches the trainer exactly once whichever replica served it.
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
from typing import Any, Callable, Sequence

import grpc
import numpy as np

from grain_elevator.client import bulk
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server import errors

RETRIABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,  # e.g. a server shutting down; ours are filtered.
})


log = logging.getLogger("grain_elevator.client")
TRANSPORTS = ("auto", "grpc", "bulk")

GET_BATCHES = "/" + pb.DESCRIPTOR.services_by_name["Elevator"].full_name + "/GetBatches"


class Cancelled(Exception):
  """The fetch was cancelled by the client (close or set_state)."""


@dataclasses.dataclass
class RetryPolicy:
  timeout_s: float = 60.0  # give up after this long without progress
  initial_backoff_s: float = 0.05
  max_backoff_s: float = 2.0
  request_timeout_s: float = 120.0  # per RPC


@dataclasses.dataclass(frozen=True)
class Security:
  """TLS material (bytes, as `grpc.ssl_channel_credentials` takes them) and a
  bearer token. Any TLS field turns TLS on."""

  root_certificates: bytes | None = None
  private_key: bytes | None = None
  certificate_chain: bytes | None = None
  auth_token: str | None = dataclasses.field(default=None, repr=False)

  @property
  def tls(self) -> bool:
    return any((self.root_certificates, self.private_key, self.certificate_chain))

  @property
  def metadata(self) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else None


class CancelToken:
  """Lets another thread cancel one fetch, including its in-flight RPC."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._cancelled = False
    self._call: Any = None

  @property
  def cancelled(self) -> bool:
    return self._cancelled

  def attach(self, call: Any) -> None:
    """`call`: a gRPC call or a bulk connection (anything with `cancel()`)."""
    with self._lock:
      self._call = call
      if self._cancelled and call is not None:
        call.cancel()

  def cancel(self) -> None:
    with self._lock:
      self._cancelled = True
      if self._call is not None:
        self._call.cancel()


_URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "local:")


def parse_targets(target: str | Sequence[str]) -> list[str]:
  """Validates "host:port" targets (or gRPC URIs such as dns:///name:port)."""
  targets = [target] if isinstance(target, str) else list(target)
  if not targets:
    raise ValueError(f"target must be 'host:port' or a list of them, got {target!r}")
  for t in targets:
    if not isinstance(t, str):
      raise ValueError(f"target must be 'host:port' or a list of them, got {target!r}")
    if t.startswith(_URI_SCHEMES):
      continue
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"target {t!r} is not 'host:port' (e.g. 'localhost:50051')")
  return targets


def check_transport(transport: str, security: Security) -> None:
  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
  if transport == "bulk" and security.tls:
    raise ValueError("the bulk transport is plaintext: use transport='grpc' (or "
                     "'auto') with TLS")


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


def _spread_over_workers(open_one: Callable[[], tuple[Any, pb.ServerInfo] | None],
                         close: Callable[[Any], None], per_target: int) -> list[list[Any]]:
  """Connections to one replica, grouped by the worker process that took each.

  The replica's workers share a port and the kernel hands each new TCP
  connection to one of them by a hash, so this opens connections (each
  reports its worker) until every worker holds ceil(per_target / workers),
  closing the surplus. Stops early when `open_one` fails (returns None).
  """
  by_worker: dict[int, list[Any]] = collections.defaultdict(list)
  for _ in range(8 * max(per_target, 4)):
    opened = open_one()
    if opened is None:
      break
    conn, server = opened
    workers = max(1, server.num_workers)
    want = -(-per_target // workers)  # per worker, at least 1
    group = by_worker[server.worker_index]
    if len(group) < want:
      group.append(conn)
    else:
      close(conn)
    if len(by_worker) >= workers and all(len(g) >= want for g in by_worker.values()):
      break
  return list(by_worker.values())


def _interleave(groups: list[list[Any]]) -> list[Any]:
  """Workers' and replicas' connections taken in turn, so consecutive
  requests spread out."""
  return [c for layer in itertools.zip_longest(*groups) for c in layer if c]


class ConnectionPool:
  """Connections to every replica; fetches steps with failover.

  A replica's worker processes share one port and the kernel assigns each
  TCP connection to one of them by a hash, so a handful of connections can
  easily all land on one worker. On first contact the pool opens the
  connections that will carry batches until each worker of each replica
  holds an equal share (the bulk handshake, or Describe over gRPC, says which
  worker answered), and closes the surplus. Where the bulk transport carries
  the batches, one gRPC channel per target is kept for Describe.
  """

  _OPTIONS = [
      ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
      # A DNS name with several replicas (a headless Service): use them all.
      ("grpc.lb_policy_name", "round_robin"),
      ("grpc.max_receive_message_length", -1),
  ]

  def __init__(self, targets: Sequence[str], *, connections_per_target: int = 4,
               retry: RetryPolicy | None = None, security: Security | None = None,
               transport: str = "auto"):
    check_transport(transport, security or Security())
    self.targets = list(targets)
    self.transport = transport
    self._bulk_ports: dict[str, int] = {}
    self._bulk = bulk.Slots([])
    self.retry = retry or RetryPolicy()
    self._security = security or Security()
    self._metadata = self._security.metadata
    self._per_target = connections_per_target
    self._lock = threading.Lock()
    self._channels: list[grpc.Channel] = []
    self._stubs: list[pb_grpc.ElevatorStub] = []
    self._get_batches: list[Any] = []
    self._next = itertools.count()
    self._closed = False
    self._balanced = False

  def _new_channel(self, target: str) -> grpc.Channel:
    sec = self._security
    if sec.tls:
      credentials = grpc.ssl_channel_credentials(
          sec.root_certificates, sec.private_key, sec.certificate_chain)
      return grpc.secure_channel(target, credentials, options=self._OPTIONS)
    return grpc.insecure_channel(target, options=self._OPTIONS)

  def _contact(self, target: str, request: pb.DescribeRequest
               ) -> tuple[grpc.Channel, pb.ServerInfo] | None:
    """A new channel to `target` and the worker that answered its Describe
    (which also says the replica's bulk port); None when down or refusing."""
    channel = self._new_channel(target)
    try:
      response = pb_grpc.ElevatorStub(channel).Describe(
          request, timeout=5, metadata=self._metadata)
    except grpc.RpcError:
      channel.close()
      return None
    self._bulk_ports[target] = response.server.bulk_port
    return channel, response.server

  def _spread(self, target: str, request: pb.DescribeRequest,
              first: tuple[grpc.Channel, pb.ServerInfo] | None = None
              ) -> list[list[grpc.Channel]]:
    """Channels to `target`, grouped by the worker process that holds them
    (`first`, if given, counts as the first one opened)."""
    opened = [first] if first else []

    def open_one() -> tuple[grpc.Channel, pb.ServerInfo] | None:
      # None: keep what we have; retries handle the rest.
      return opened.pop() if opened else self._contact(target, request)

    groups = _spread_over_workers(open_one, lambda c: c.close(), self._per_target)
    if not groups:  # unreachable now: plain channels that connect later
      return [[self._new_channel(target)] for _ in range(self._per_target)]
    return groups

  def _balance(self, request: pb.DescribeRequest) -> None:
    with self._lock:
      if self._balanced or self._closed:
        return
      first: dict[str, tuple[grpc.Channel, pb.ServerInfo] | None] = {}
      slots: list[bulk.Slot] = []
      if self.transport != "grpc" and not self._security.tls:
        # Bulk connections will carry the batches wherever a replica offers
        # them: balance those, and keep one gRPC channel per target (a
        # balanced set of channels costs ~10 ms each to set up, at every
        # start and resume, for nothing).
        first = {t: self._contact(t, request) for t in self.targets}
        slots = _interleave([g for t in self.targets for g in self._spread_bulk(t)])
      if slots:
        channels = [f[0] if f else self._new_channel(t) for t, f in first.items()]
      else:
        channels = _interleave(
            [g for t in self.targets for g in self._spread(t, request, first.get(t))])
      self._channels = channels
      self._stubs = [pb_grpc.ElevatorStub(c) for c in channels]
      # Batches are parsed by hand: tensors become views of the received bytes.
      self._get_batches = [
          c.unary_stream(GET_BATCHES, request_serializer=pb.BatchRequest.SerializeToString,
                         response_deserializer=wire.decode_batch_bytes)
          for c in channels]
      self._failures = [0] * len(channels)
      self._shunned_until = [0.0] * len(channels)
      self._bulk = bulk.Slots(slots)
      if self.transport == "bulk" and not self._bulk:
        raise errors.ServiceUnavailableError(
            f"transport='bulk', but no replica of {', '.join(self.targets)} offers a "
            "reachable bulk port (is it started with --no-bulk or TLS?)")
      self._balanced = True

  def _spread_bulk(self, target: str) -> list[list[bulk.Slot]]:
    """Bulk connections to each replica behind `target`, balanced over its
    workers like `_spread`; none where a replica offers no bulk port or it
    cannot be reached (gRPC then)."""
    port = self._bulk_ports.get(target, 0)
    groups: list[list[bulk.Slot]] = []
    for host in _bulk_hosts(target) if port else []:
      failures: list[bulk.BulkRpcError] = []

      def open_one(host: str = host, failures: list[bulk.BulkRpcError] = failures
                   ) -> tuple[bulk.Slot, pb.ServerInfo] | None:
        try:
          conn = bulk.BulkConnection(host, port)
        except bulk.BulkRpcError as e:
          failures.append(e)
          return None
        return bulk.Slot(target, host, conn), conn.server

      found = _spread_over_workers(open_one, lambda s: s.conn.close(), self._per_target)
      if not found:
        log.warning("%s: bulk port %s:%d unreachable (%s); using gRPC", target, host,
                    port, failures[-1].details())
      groups += found
    return groups

  @property
  def uses_bulk(self) -> bool:
    """Whether batches travel over the bulk transport (after the first request)."""
    return bool(self._bulk)

  @property
  def num_connections(self) -> int:
    return len(self._channels)

  def close(self) -> None:
    with self._lock:
      self._closed = True
      for c in self._channels:
        c.close()
    self._bulk.close()

  def _pick(self) -> int:
    """Round-robin over connections, skipping any that failed recently."""
    start, n, now = next(self._next), len(self._stubs), time.monotonic()
    for k in range(n):
      i = (start + k) % n
      if self._shunned_until[i] <= now:
        return i
    return start % n  # all failing: keep trying them in turn

  def _failed(self, i: int) -> None:
    """Shun connection i for 0.5 s, doubling per consecutive failure, up to 30 s,
    so a dead or frozen replica stops costing one timeout per request."""
    self._failures[i] += 1
    self._shunned_until[i] = time.monotonic() + min(30.0, 0.5 * 2**(self._failures[i] - 1))

  def _succeeded(self, i: int) -> None:
    self._failures[i] = 0

  def _backoff(self, attempt: int) -> float:
    cap = min(self.retry.max_backoff_s, self.retry.initial_backoff_s * 2**attempt)
    return random.uniform(cap / 2, cap)

  def _give_up(self, what: str, last: grpc.RpcError | None) -> errors.ServiceUnavailableError:
    detail = f" (last error: {last.code().name}: {last.details()})" if last else ""
    return errors.ServiceUnavailableError(
        f"no replica of {', '.join(self.targets)} could serve {what} within "
        f"{self.retry.timeout_s:.0f}s{detail}")

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    request = pb.DescribeRequest(dataset=dataset, global_batch_size=global_batch_size)
    self._balance(request)
    deadline = time.monotonic() + self.retry.timeout_s
    last = None
    for attempt in itertools.count():
      try:
        i = self._pick()
        response = self._stubs[i].Describe(
            request, timeout=self.retry.request_timeout_s, metadata=self._metadata)
        self._succeeded(i)
        return [DatasetInfo.from_proto(d) for d in response.datasets]
      except grpc.RpcError as e:
        if e.code() not in RETRIABLE or self._closed:
          raise errors.from_status(e.code(), e.details()) from e
        self._failed(i)
        last = e
      if time.monotonic() >= deadline:
        raise self._give_up(f"Describe({dataset!r})", last)
      time.sleep(self._backoff(attempt))
    raise AssertionError("unreachable")

  def fetch(self, request: pb.BatchRequest, token: CancelToken,
            out: list[list[np.ndarray]] | None = None) -> list[list[np.ndarray]]:
    """Steps [start, start+num) of `request`, in order, from any replica.

    Each step is appended to `out` (a new list by default) as it arrives, so
    a caller may take early steps before the request ends."""
    self._balance(pb.DescribeRequest(dataset=request.dataset))
    out = [] if out is None else out
    deadline = time.monotonic() + self.retry.timeout_s
    last = None
    attempt = 0
    while True:
      remaining = pb.BatchRequest()
      remaining.CopyFrom(request)
      remaining.start_step = request.start_step + len(out)
      remaining.num_steps = request.num_steps - len(out)
      progress = len(out)
      try:
        if self._bulk:
          self._fetch_bulk(remaining, token, out, request.start_step)
        else:
          self._fetch_grpc(remaining, token, out, request.start_step)
        return out
      except grpc.RpcError as e:
        if token.cancelled or self._closed:
          raise Cancelled() from e
        if e.code() not in RETRIABLE:
          raise errors.from_status(e.code(), e.details()) from e
        last = e
        if len(out) == request.num_steps:  # died after its last step: all here
          return out
        if len(out) > progress:
          deadline = time.monotonic() + self.retry.timeout_s  # progress made
          attempt = 0
      if time.monotonic() >= deadline:
        raise self._give_up(
            f"dataset {request.dataset!r} step {request.start_step + len(out)}", last)
      time.sleep(self._backoff(attempt))
      attempt += 1
      if token.cancelled:
        raise Cancelled()

  @staticmethod
  def _append(out: list[list[np.ndarray]], first: int, step: int,
              leaves: list[np.ndarray], dataset: str) -> None:
    if step != first + len(out):  # never deliver out of order
      raise errors.ElevatorError(
          f"{dataset!r}: server sent step {step}, expected {first + len(out)}")
    out.append(leaves)

  def _fetch_grpc(self, request: pb.BatchRequest, token: CancelToken,
                  out: list[list[np.ndarray]], first: int) -> None:
    i = self._pick()
    try:
      call = self._get_batches[i](
          request, timeout=self.retry.request_timeout_s, metadata=self._metadata)
      token.attach(call)
      for step, leaves in call:
        self._append(out, first, step, leaves, request.dataset)
    except grpc.RpcError as e:
      if e.code() in RETRIABLE:
        self._failed(i)
      raise
    finally:
      token.attach(None)
    self._succeeded(i)

  def _fetch_bulk(self, request: pb.BatchRequest, token: CancelToken,
                  out: list[list[np.ndarray]], first: int) -> None:
    slot = self._bulk.checkout(lambda: token.cancelled or self._closed)
    if slot is None:
      raise Cancelled()
    stream, failed = None, False
    try:
      if slot.conn.broken:
        slot.conn.close()
        slot.conn = self._reconnect(slot)
      token.attach(slot.conn)
      stream = slot.conn.stream(request, timeout_s=self.retry.request_timeout_s,
                                auth_token=self._security.auth_token)
      for step, leaves in stream:
        self._append(out, first, step, leaves, request.dataset)
    except grpc.RpcError as e:
      failed = e.code() in RETRIABLE
      raise
    finally:
      token.attach(None)
      if stream is not None:
        stream.close()  # marks the connection spent if frames were left unread
      self._bulk.release(slot, failed=failed)

  def _reconnect(self, slot: bulk.Slot) -> bulk.BulkConnection:
    """A new bulk connection to the slot's replica, asking its current bulk
    port if refused: a restarted server may have picked another free port."""
    target, host = slot.target, slot.host
    timeout = min(5.0, self.retry.request_timeout_s)  # a frozen host accepts, then hangs
    try:
      return bulk.BulkConnection(host, self._bulk_ports[target], connect_timeout_s=timeout)
    except bulk.BulkRpcError as e:
      if not isinstance(e.__cause__, ConnectionRefusedError):
        raise  # up but not answering (frozen): asking again would only wait again
      channel = self._new_channel(target)
      try:
        response = pb_grpc.ElevatorStub(channel).Describe(
            pb.DescribeRequest(), timeout=timeout, metadata=self._metadata)
      except grpc.RpcError:
        raise bulk.BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                                f"replica {target} is unreachable") from None
      finally:
        channel.close()
      if not response.server.bulk_port:
        raise bulk.BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                                f"replica {target} no longer offers the bulk transport")
      self._bulk_ports[target] = response.server.bulk_port
      return bulk.BulkConnection(host, response.server.bulk_port, connect_timeout_s=timeout)
