"""The client's connections: one interface, a gRPC and a bulk implementation.

A `Connection` streams the steps of one request and fails with a
`TransportError` carrying the status the server (or the network) gave. The
pool (client/connections.py) sees nothing else, so retry, backoff,
shunning and fallback are written once for both transports. The bulk
implementation is client/bulk.py.

Nothing a server sends is trusted: every message's size is bounded before
it is allocated, and every step is checked against the element spec
(`decode_step`) before the trainer sees it. A reply that breaks either is
a `BadReplyError`, which the pool retries on another replica.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Protocol, Sequence

import grpc
import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import errors
from grain_elevator.proto import wire
from grain_elevator.client.options import Security
from grain_elevator.proto.spec import LeafSpec

SERVICE = pb.DESCRIPTOR.services_by_name["Elevator"].full_name
GET_BATCHES = f"/{SERVICE}/GetBatches"
Steps = Iterator[tuple[int, list[np.ndarray]]]
# The longest Describe answer a client accepts (a few KiB is usual), and the
# limit on batches of a channel opened before any element spec is known.
MAX_CONTROL_MESSAGE_BYTES = 4 << 20
# gRPC's channel arguments are C ints (and its messages under 4 GiB anyway).
_MAX_CHANNEL_LIMIT = (1 << 31) - 1
# How grpcio words its own refusal of a message over a limit it was given.
_OVER_LIMIT = "Received message larger than max"


class TransportError(Exception):
  """A failed request or connection, with the status it ended in.

  The pool notes where it happened (`replica`, `over_bulk`), so that the
  retry can go somewhere else."""

  replica: tuple[str, str] | None = None  # (target, host) of the connection
  over_bulk: bool = False

  def __init__(self, code: grpc.StatusCode, details: str, error_type: str = ""):
    super().__init__(f"{code.name}: {details}")
    self.code, self.details, self.error_type = code, details, error_type

  def to_error(self) -> errors.ElevatorError:
    """The typed error a trainer sees for it."""
    return errors.from_status(self.code, self.details, self.error_type)


class BadReplyError(TransportError):
  """A server's reply that breaks the element spec, the size bounds or the
  protocol. The replica is at fault (a bug, a bad build, corrupted memory,
  an impostor), not the data: the pool asks another replica, and raises
  DataLossError only if every replica does the same."""

  def __init__(self, details: str):
    super().__init__(grpc.StatusCode.DATA_LOSS, details, errors.DataLossError.__name__)


def decode_step(payload: Any, request: pb.BatchRequest, index: int, max_bytes: int,
                expect: Sequence[LeafSpec] | None, server: str) -> tuple[int, list[np.ndarray]]:
  """Step `index` of `request` from a received Batch, checked against its
  size bound, `expect` (the leaves the spec gives it) and the step it must
  be. `server` names the sender and its transport for the error."""
  step = request.start_step + index
  if len(payload) > max_bytes:
    raise BadReplyError(
        f"{server} sent {len(payload)} bytes for dataset {request.dataset!r} step {step}, "
        f"over the {max_bytes} its element spec allows")
  try:
    got, leaves = wire.decode_batch_bytes(payload, expect)
  except wire.BadBatchError as e:
    raise BadReplyError(f"{server} sent a bad batch for dataset {request.dataset!r} "
                        f"step {step}: {e}") from None
  if got != step:
    raise BadReplyError(f"{server} sent step {got} for dataset {request.dataset!r} "
                        f"step {step}")
  return got, leaves


class CancelToken:
  """Lets another thread cancel one fetch, including its request in flight."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._cancelled = False
    self._call: Any = None

  @property
  def cancelled(self) -> bool:
    return self._cancelled

  def attach(self, call: Any) -> None:
    """`call`: what `cancel()` must interrupt (a gRPC call, a bulk connection)."""
    with self._lock:
      self._call = call
      if self._cancelled and call is not None:
        call.cancel()

  def cancel(self) -> None:
    with self._lock:
      self._cancelled = True
      if self._call is not None:
        self._call.cancel()


class Connection(Protocol):
  """One TCP connection to one worker of one replica."""

  target: str  # as the user gave it
  host: str  # the replica's address behind the target
  server: pb.ServerInfo  # the worker that took the connection
  capacity: int  # requests it carries at once
  broken: bool  # must be reopened before its next request

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int, expect: Sequence[LeafSpec] | None = None) -> Steps:
    """(step, leaves) for each step of `request`, in order; TransportError
    on failure. `timeout_s` bounds the request (bulk: each wait for data). A
    step message over `max_frame_bytes`, or whose leaves are not those
    `expect` gives, is a BadReplyError before it is decoded; what is
    allocated before that check is bounded too (bulk: by the frame header,
    gRPC: by the channel's limits)."""

  def close(self) -> None: ...


def _over_limit(e: grpc.RpcError) -> bool:
  """Whether gRPC refused a message for being over one of its limits."""
  return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _OVER_LIMIT in (e.details() or "")


def _grpc_error(e: grpc.RpcError) -> TransportError:
  type_name = ""
  trailers = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
  for key, value in trailers or ():
    if key == errors.ERROR_TYPE_KEY:
      type_name = value
  return TransportError(e.code(), e.details() or "", type_name)


class GrpcConnection:
  """A gRPC channel of its own (one TCP connection); it reconnects by itself
  and carries any number of requests at once.

  gRPC refuses a message over its method's limit from its length prefix,
  before receiving it: a Batch over `max_batch_bytes`, a Describe answer
  over MAX_CONTROL_MESSAGE_BYTES. The limits are fixed when the channel is
  made, so the pool opens the channels that carry batches once it knows
  the element spec (client/connections.py).
  """

  _OPTIONS = [
      ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
      # A DNS name with several replicas (a headless Service): use them all.
      ("grpc.lb_policy_name", "round_robin"),
  ]
  capacity = 1 << 30
  broken = False

  def __init__(self, target: str, security: Security,
               max_batch_bytes: int = MAX_CONTROL_MESSAGE_BYTES):
    self.target = self.host = target
    self.server = pb.ServerInfo()
    self.max_batch_bytes = min(max_batch_bytes, _MAX_CHANNEL_LIMIT)
    self._metadata = security.metadata
    # Per-method limits (gRPC applies the smaller of these and the channel's),
    # ours alone: none taken from DNS.
    config = {"methodConfig": [
        {"name": [{"service": SERVICE}], "maxResponseMessageBytes": MAX_CONTROL_MESSAGE_BYTES},
        {"name": [{"service": SERVICE, "method": "GetBatches"}],
         "maxResponseMessageBytes": self.max_batch_bytes}]}
    options = [*self._OPTIONS,
               ("grpc.max_receive_message_length",
                max(self.max_batch_bytes, MAX_CONTROL_MESSAGE_BYTES)),
               ("grpc.service_config", json.dumps(config)),
               ("grpc.service_config_disable_resolution", 1)]
    if security.tls:
      credentials = grpc.ssl_channel_credentials(
          security.root_certificates, security.private_key, security.certificate_chain)
      self._channel = grpc.secure_channel(target, credentials, options=options)
      self._name = f"{target} (gRPC, TLS)"
    else:
      self._channel = grpc.insecure_channel(target, options=options)
      self._name = f"{target} (gRPC)"
    self._describe = pb_grpc.ElevatorStub(self._channel).Describe
    # Batches are parsed by hand (decode_step): tensors become views of the
    # received bytes.
    self._get_batches = self._channel.unary_stream(
        GET_BATCHES, request_serializer=pb.BatchRequest.SerializeToString)

  def describe(self, request: pb.DescribeRequest, *, timeout_s: float) -> pb.DescribeResponse:
    try:
      response = self._describe(request, timeout=timeout_s, metadata=self._metadata)
    except grpc.RpcError as e:
      if _over_limit(e):
        raise BadReplyError(f"{self._name} sent a Describe answer over "
                            f"{MAX_CONTROL_MESSAGE_BYTES} bytes (refused unread: "
                            f"{e.details()})") from e
      raise _grpc_error(e) from e
    self.server = response.server
    return response

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int, expect: Sequence[LeafSpec] | None = None) -> Steps:
    """See `Connection.stream`. gRPC receives a message whole before this
    sees it: the channel's limit bounds that, this checks the exact one."""
    where = self._name
    call = self._get_batches(request, timeout=timeout_s, metadata=self._metadata)
    token.attach(call)
    index = 0
    try:
      for payload in call:
        yield decode_step(payload, request, index, max_frame_bytes, expect, where)
        index += 1
    except grpc.RpcError as e:
      if _over_limit(e):
        raise BadReplyError(
            f"{where} sent a message for dataset {request.dataset!r} step "
            f"{request.start_step + index} over the channel's limit of "
            f"{self.max_batch_bytes} bytes from the element spec (refused unread: "
            f"{e.details()})") from e
      raise _grpc_error(e) from e
    finally:
      call.cancel()  # a no-op once it ended; else stops a stream left half read
      token.attach(None)

  def close(self) -> None:
    self._channel.close()
