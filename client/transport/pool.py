"""The client's connection pool: connections to every replica, Describe,
and fetching steps with failover.

On first contact the pool opens gRPC channels that take no answer over the
control limit (connection.py), learns each dataset's element spec, and only
then opens the connections that carry batches, balanced over every worker
of every replica (slots.py), by default REQUESTS_PER_WORKER on each
(options.py; each replica's first connection says how many workers it
has): bulk connections where a replica offers a reachable bulk port
(`auto`), else gRPC channels limited to a whole global batch of the
dataset and G first asked about (`_open_data`; reopened larger should a
later request need more). Each step is checked exactly: its size,
and its leaves against the spec. Every request runs through the Retrier
(retry.py); where an attempt goes after RESOURCE_EXHAUSTED is this pool's
choice (`_after_full`), since it knows the replicas and transports.

Bulk connections are plain sockets, so nothing re-resolves a
"dns:///name:port" target for them: the pool asks DNS again before each
reconnect and every `TransportOptions.dns_refresh_s` (`_refresh`). An
address new behind the name gets connections; one that left is retired
after its current request, so a rolling update of a headless Service moves
the trainer to the new pods.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import zlib
from typing import Any, Callable, Sequence, TypeVar

import grpc

from grain_elevator.client.transport.buffers import BufferPool
from grain_elevator.client.transport.bulk_connection import BulkConnection
from grain_elevator.client.transport.connection import (MAX_CONTROL_MESSAGE_BYTES,
                                                        BadReplyError, CancelToken, Step,
                                                        TransportError, check_position)
from grain_elevator.client.transport.grpc_connection import GrpcConnection
from grain_elevator.client.transport.host_memory import PAGEABLE, HostMemory
from grain_elevator.client.transport.options import (REQUESTS_PER_WORKER, WINDOW_BYTES,
                                                     RetryPolicy, Security, TransportOptions)
from grain_elevator.client.transport.retry import REFUSED, RETRIABLE, Retrier
from grain_elevator.client.transport.slots import (Slot, Slots, interleave,
                                                   spread_over_workers)
from grain_elevator.client.transport.targets import bulk_hosts
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import limits
from grain_elevator.proto.spec import DatasetInfo, LeafSpec

log = logging.getLogger("grain_elevator.client")
T = TypeVar("T")

# Receive buffers kept for reuse: a default window of WINDOW_BYTES holds up
# to one step of 1 MB per MB, the smallest that need keeping (buffers.py).
_POOLED_BUFFERS = WINDOW_BYTES >> 20

# Reconnects come in bursts (every connection to a pod that left breaks at
# once): DNS is asked at most this often.
_MIN_RESOLVE_GAP_S = 0.5


class ConnectionPool:
  """Connections to every replica; describes datasets and fetches steps with
  failover."""

  def __init__(self, targets: Sequence[str], *,
               transport: TransportOptions = TransportOptions(),
               retry: RetryPolicy = RetryPolicy(), security: Security = Security(),
               host_memory: HostMemory | None = None,
               window_bytes: int = WINDOW_BYTES):
    """`host_memory`: where bulk connections receive (host_memory.py);
    `window_bytes`: the most the iterator keeps in flight (client/window.py),
    which the pool of receive buffers is sized to hold."""
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
    # (dataset, G, shard count) -> (its info, `_expect`'s limit and leaves,
    # a whole global batch's limit), derived from that info; written by
    # fetch threads, a race at worst deriving one twice
    self._expected: dict[tuple[str, int, int],
                         tuple[DatasetInfo, int, tuple[LeafSpec, ...], int]] = {}
    self._refresh_lock = threading.Lock()
    self._resolved_at: dict[str, float] = {}
    self._next_refresh = 0.0
    self._retrier: Retrier[Slots] = Retrier(retry, self.targets, lambda: self._closed)
    # One pool for all bulk connections: the buffer the trainer dropped last
    # is the one still in cache, whichever connection reads next. Room for
    # the window and the batches the trainer still holds: a window beyond
    # the pool would get buffers of its own, page-faulted in for each step.
    self._buffers = BufferPool(memory=host_memory or PAGEABLE,  # host_memory.py
                               max_buffers=_POOLED_BUFFERS,
                               max_bytes=window_bytes + window_bytes // 4)
    self.uses_bulk = False
    self.times_steps = True  # servers say how long a step takes (Step.production_s)
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
      response = self._retrier.run(lambda: f"Describe at {target}", ask, None,
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

  def _per_worker(self) -> int:
    """Connections per worker of a default client (connections_per_target
    None): REQUESTS_PER_WORKER, or where it reads only streams, whose
    requests go one at a time to the worker that owns the stream, one per
    sub-stream a worker may own (two where N sub-streams are more than
    the workers, up to REQUESTS_PER_WORKER)."""
    streams = [self._stream(name) for name in self._infos]
    if not streams or None in streams:
      return REQUESTS_PER_WORKER
    return min(REQUESTS_PER_WORKER, max(info.stream_shards for info in streams if info))

  def _stream(self, dataset: str) -> DatasetInfo | None:
    """`dataset`'s Describe answer if it is a stream dataset, else None (read
    by step, or not described yet): the one place the pool reads
    `DatasetInfo.stream`. A stream's chunks go to the one worker that owns
    it, and their positions are checked against its start."""
    info = self._infos.get(dataset)
    return info if info is not None and info.stream else None

  def _spread_grpc(self, target: str, max_batch_bytes: int) -> list[list[Any]]:
    groups = spread_over_workers(lambda: self._contact(target, max_batch_bytes),
                                  self.transport.connections_per_target, self._per_worker())
    if not groups:  # unreachable now: plain channels that connect later
      return [[GrpcConnection(target, self._security, max_batch_bytes)]
              for _ in range(self.transport.connections_per_target or REQUESTS_PER_WORKER)]
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

    found = spread_over_workers(open_one, self.transport.connections_per_target,
                                self._per_worker())
    return found, (failures[-1] if failures and not found else None)

  def _spread_bulk(self, target: str) -> list[list[Any]]:
    """Bulk connections to each replica behind `target`, balanced over its
    workers; none where a replica offers no bulk port or it cannot be
    reached (gRPC then)."""
    port = self._bulk_ports.get(target, 0)
    groups: list[list[Any]] = []
    for host in bulk_hosts(target) if port else []:
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
        data = interleave([g for t in self.targets for g in self._spread_bulk(t)])
        if self.transport.kind == "bulk" and not data:
          raise errors.ServiceUnavailableError(
              f"transport kind 'bulk', but no replica of {', '.join(self.targets)} offers "
              "a reachable bulk port (is it started with --bulk off or TLS?)")
        self.uses_bulk = bool(data)
      if self.uses_bulk:  # gRPC carries only the requests falling back: the control channels
        old = list(self._control)
        self._control.add([Slot(GrpcConnection(t, self._security, max_batch_bytes))
                           for t in self.targets])
        self._control.retire(lambda s: s in old)
      else:  # gRPC carries the batches: balance its channels
        old = list(self._data)
        data = interleave([g for t in self.targets
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

  @property
  def parallelism(self) -> int:
    """Requests in flight that keep the servers busy: one per connection
    carrying batches (a default client opens REQUESTS_PER_WORKER per worker
    of every replica). The iterator's window starts there (client/window.py)."""
    return max(1, sum(not s.retired for s in self._data))

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
      hosts = bulk_hosts(target)
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
        self._data.add([Slot(c) for c in interleave(groups)])
      if gone and (groups or have - gone):
        self._data.retire(lambda s: s.conn.target == target and s.conn.host in gone)
      if groups or gone:
        log.info("%s now resolves to %s: %d bulk connections opened, %s retired", target,
                 ", ".join(hosts), sum(map(len, groups)), ", ".join(sorted(gone)) or "none")
    finally:
      self._refresh_lock.release()

  # -- the request path ------------------------------------------------------

  @property
  def retries(self) -> int:
    """Attempts tried again (client/stats.py)."""
    return self._retrier.retries

  def _after_full(self, e: TransportError, slots: Slots | None) -> tuple[Slots | None, str]:
    """Where to retry after a replica answered RESOURCE_EXHAUSTED (full right
    now; `_with_slot` has shunned it), and what the warning says: another
    replica if one has room, else gRPC if it came over bulk (`auto` only:
    `bulk` was asked for), else the same slots once the backoff has passed."""
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
    return use, move

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
    liars: set[tuple[str, str]] = set()

    def attempt(slots: Slots | None) -> pb.DescribeResponse:
      assert slots is not None
      try:
        return self._with_slot(slots, lambda s: _checked_describe(s.conn.describe(
            request, timeout_s=self.retry.request_timeout_s), s.conn.target))
      except BadReplyError as e:  # DataLossError once every replica has lied
        self._retrier.lied(e, liars, {s.replica for s in slots if not s.retired})
        raise

    response = self._retrier.run(lambda: f"Describe({dataset!r})", attempt, self._control,
                                 after_full=self._after_full)
    infos = [DatasetInfo.from_proto(d) for d in response.datasets]
    self._infos.update((i.name, i) for i in infos)
    if global_batch_size > 0 and infos:
      self._open_data(max(i.element_spec.max_batch_bytes(global_batch_size) for i in infos))
    return infos

  def fetch(self, request: pb.BatchRequest, token: CancelToken,
            out: list[Step] | None = None) -> list[Step]:
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
    stream = self._stream(request.dataset)
    if stream is not None:
      # A stream's chunks all go to one worker, whose live iterator continues
      # from each chunk's end (server/serving/stream_sessions.py).
      # Sub-stream j (of a stream of several) to the worker after: N
      # sub-streams keep N workers busy, one per replica first (owner_of).
      route = zlib.crc32(f"{request.dataset}/{stream.config_fingerprint}".encode())
      route += request.stream_shard
    else:
      route = request.start_step // max(1, request.num_steps)
    liars: set[tuple[str, str]] = set()
    positions_of = stream.starts[request.stream_shard] if stream is not None else None

    def attempt(slots: Slots | None) -> list[Step]:
      assert slots is not None
      remaining = copy.deepcopy(request)
      remaining.start_step = request.start_step + len(out)
      remaining.num_steps = request.num_steps - len(out)
      if out and out[-1].next_stream_state:
        remaining.stream_state = out[-1].next_stream_state  # a stream: after the last

      def stream(slot: Slot) -> None:
        for _, leaves, state, production_us in slot.conn.stream(
            remaining, timeout_s=self.retry.request_timeout_s, token=token,
            max_frame_bytes=limit, expect=expect, positions_of=positions_of):
          # the step it must be, checked (decode_step)
          out.append(Step(leaves, state, production_us / 1e6))
          slot.served += 1

      try:
        self._with_slot(slots, stream, lambda: token.cancelled, route=route)
      except BadReplyError as e:
        self._retrier.lied(e, liars, {s.replica for s in self._data if not s.retired})
        raise
      except TransportError:
        if len(out) == request.num_steps:  # it failed after its last step: all here
          return out
        raise
      return out

    return self._retrier.run(
        lambda: f"dataset {request.dataset!r} step {request.start_step + len(out)}",
        attempt, self._data, cancelled=lambda: token.cancelled, progress=lambda: len(out),
        after_full=self._after_full)

  def skip(self, request: pb.BatchRequest, token: CancelToken) -> pb.SkipResponse:
    """The position after the steps of `request` (a stream dataset's; at
    most limits.skip_steps(G)), none of them sent, from any replica; checked to be
    one of its stream's."""
    self._open_control()
    info = self._infos.get(request.dataset)
    if info is None:
      (info,) = self.describe(request.dataset)

    def attempt(slots: Slots | None) -> pb.SkipResponse:
      assert slots is not None
      answer = self._with_slot(slots, lambda s: s.conn.skip(
          request, timeout_s=self.retry.request_timeout_s, token=token),
          lambda: token.cancelled)
      end = request.start_step + request.num_steps
      if answer.next_step != end:
        raise BadReplyError(f"a Skip of dataset {request.dataset!r} to step {end} was "
                            f"answered for step {answer.next_step}")
      check_position(answer.next_stream_state, request, end - 1, "a Skip answer",
                     info.starts[request.stream_shard])
      return answer

    return self._retrier.run(
        lambda: f"Skip of dataset {request.dataset!r} from step {request.start_step}",
        attempt, self._control, cancelled=lambda: token.cancelled,
        after_full=self._after_full)

  def explain(self, request: pb.ExplainRequest) -> dict[str, Any]:
    """What one step held, from any replica (Explain's JSON, parsed)."""
    self._open_control()
    answer = self._retrier.run(
        lambda: f"Explain of dataset {request.request.dataset!r} step "
        f"{request.request.start_step}",
        lambda slots: self._with_slot(slots, lambda s: s.conn.explain(
            request, timeout_s=self.retry.request_timeout_s)),
        self._control, after_full=self._after_full)
    try:
      explained = json.loads(answer.json)
    except ValueError as e:
      raise errors.InternalError(f"an Explain answer is not JSON: {e}") from None
    if not isinstance(explained, dict) or not isinstance(
        explained.get("components" if request.summary else "rows"), (dict, list)):
      raise errors.InternalError("an Explain answer is not an explanation")
    return explained

  def _expect(self, request: pb.BatchRequest) -> tuple[int, tuple[LeafSpec, ...]]:
    """What each step of `request` must be, from the dataset's element spec:
    the longest message it can take, and its leaves. Opens (or enlarges)
    the connections carrying batches to accept it."""
    info = self._infos.get(request.dataset)
    if info is None:
      (info,) = self.describe(request.dataset)
    rows = len(_rows(request))
    # Once per dataset and G, not per request: the same tuple each time, so
    # a bulk connection reuses its layout (bulk_connection.py).
    key = (request.dataset, request.global_batch_size, request.shard_count,
           request.shard_index if request.stream_shards > 1 else 0, request.stream_shard)
    known = self._expected.get(key)
    if known is None or known[0] is not info:  # described again: derive again
      spec = info.element_spec
      known = self._expected[key] = (info, spec.max_batch_bytes(rows), spec.batch_leaves(rows),
                                     spec.max_batch_bytes(request.global_batch_size))
    _, limit, leaves, whole = known
    if self._batch_cap < limit:
      self._open_data(whole)
    return limit, leaves

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


def _checked_describe(answer: pb.DescribeResponse, server: str) -> pb.DescribeResponse:
  """`answer`, unless it describes a stream of more sub-streams than a
  client runs fetch threads for (MAX_STREAM_SHARDS), or not one first
  position each: BadReplyError, before any thread or request is made."""
  for d in answer.datasets:
    n = max(1, d.stream_shards)
    if n > limits.MAX_STREAM_SHARDS or (n > 1 and len(d.stream_starts) != n):
      raise BadReplyError(
          f"{server} describes dataset {d.name!r} as {d.stream_shards} sub-streams with "
          f"{len(d.stream_starts)} first positions; a stream has at most "
          f"{limits.MAX_STREAM_SHARDS} (MAX_STREAM_SHARDS), each with its own")
  return answer


def _rows(request: pb.BatchRequest) -> range:
  """The rows of each step of `request`: this host's of its global batches,
  or of its sub-stream's sub-batches (proto/contract.py)."""
  if request.stream_shards > 1:
    return contract.sub_stream_rows(request.global_batch_size, request.shard_index,
                                    request.shard_count, request.stream_shard,
                                    request.stream_shards)
  return contract.host_rows(request.global_batch_size, request.shard_index,
                            max(1, request.shard_count))
