"""The client's connections: one interface, a gRPC and a bulk implementation.

A `Connection` streams the steps of one request and fails with a
`TransportError` carrying the status the server (or the network) gave. The
pool (client/connections.py) sees nothing else, so retry, backoff,
shunning and fallback are written once for both transports. The bulk
implementation is client/bulk.py.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Protocol

import grpc
import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import errors
from grain_elevator.proto import wire
from grain_elevator.client.options import Security

GET_BATCHES = "/" + pb.DESCRIPTOR.services_by_name["Elevator"].full_name + "/GetBatches"
Steps = Iterator[tuple[int, list[np.ndarray]]]


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
             max_frame_bytes: int) -> Steps:
    """(step, leaves) for each step of `request`; TransportError on failure.
    `timeout_s` bounds the request (bulk: each wait for data); a step message
    longer than `max_frame_bytes` is refused before it is allocated."""

  def close(self) -> None: ...


def _grpc_error(e: grpc.RpcError) -> TransportError:
  type_name = ""
  trailers = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
  for key, value in trailers or ():
    if key == errors.ERROR_TYPE_KEY:
      type_name = value
  return TransportError(e.code(), e.details() or "", type_name)


class GrpcConnection:
  """A gRPC channel of its own (one TCP connection); it reconnects by itself
  and carries any number of requests at once."""

  _OPTIONS = [
      ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
      # A DNS name with several replicas (a headless Service): use them all.
      ("grpc.lb_policy_name", "round_robin"),
      ("grpc.max_receive_message_length", -1),
  ]
  capacity = 1 << 30
  broken = False

  def __init__(self, target: str, security: Security):
    self.target = self.host = target
    self.server = pb.ServerInfo()
    self._metadata = security.metadata
    if security.tls:
      credentials = grpc.ssl_channel_credentials(
          security.root_certificates, security.private_key, security.certificate_chain)
      self._channel = grpc.secure_channel(target, credentials, options=self._OPTIONS)
    else:
      self._channel = grpc.insecure_channel(target, options=self._OPTIONS)
    self._describe = pb_grpc.ElevatorStub(self._channel).Describe
    # Batches are parsed by hand: tensors become views of the received bytes.
    self._get_batches = self._channel.unary_stream(
        GET_BATCHES, request_serializer=pb.BatchRequest.SerializeToString,
        response_deserializer=wire.decode_batch_bytes)

  def describe(self, request: pb.DescribeRequest, *, timeout_s: float) -> pb.DescribeResponse:
    try:
      response = self._describe(request, timeout=timeout_s, metadata=self._metadata)
    except grpc.RpcError as e:
      raise _grpc_error(e) from e
    self.server = response.server
    return response

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int) -> Steps:
    del max_frame_bytes  # gRPC's own receive limit applies (the channel's)
    call = self._get_batches(request, timeout=timeout_s, metadata=self._metadata)
    token.attach(call)
    try:
      yield from call
    except grpc.RpcError as e:
      raise _grpc_error(e) from e
    finally:
      token.attach(None)

  def close(self) -> None:
    self._channel.close()
