"""A connection over gRPC: a channel of its own, limits fixed when it is made.

gRPC refuses a message over its method's limit from its length prefix,
before receiving it; this connection then checks each step exactly
(`decode_step`). TLS and other languages' servers go this way.
"""

from __future__ import annotations

import json
from typing import Sequence

import grpc

from grain_elevator.client.transport.options import Security
from grain_elevator.client.transport.connection import (MAX_CONTROL_MESSAGE_BYTES,
                                                        BadReplyError, CancelToken, Steps,
                                                        TransportError, decode_step)
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import errors
from grain_elevator.proto.spec import LeafSpec

SERVICE = pb.DESCRIPTOR.services_by_name["Elevator"].full_name
GET_BATCHES = f"/{SERVICE}/GetBatches"
# gRPC's channel arguments are C ints (and its messages under 4 GiB anyway).
_MAX_CHANNEL_LIMIT = (1 << 31) - 1
# How grpcio words its own refusal of a message over a limit it was given.
_OVER_LIMIT = "Received message larger than max"


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
  the element spec (client/transport/pool.py).
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
    self._skip = pb_grpc.ElevatorStub(self._channel).Skip
    self._explain = pb_grpc.ElevatorStub(self._channel).Explain
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

  def skip(self, request: pb.BatchRequest, *, timeout_s: float,
           token: CancelToken | None = None) -> pb.SkipResponse:
    """A stream dataset's position after the steps of `request`, none of
    them sent (Skip); the answer is a control message, bounded as Describe's."""
    try:
      future = self._skip.future(request, timeout=timeout_s, metadata=self._metadata)
      if token is not None:
        token.attach(future)
      return future.result()
    except grpc.RpcError as e:
      if _over_limit(e):
        raise BadReplyError(f"{self._name} sent a Skip answer over "
                            f"{MAX_CONTROL_MESSAGE_BYTES} bytes (refused unread)") from e
      raise _grpc_error(e) from e
    except grpc.FutureCancelledError as e:
      raise TransportError(grpc.StatusCode.CANCELLED, "cancelled") from e

  def explain(self, request: pb.ExplainRequest, *, timeout_s: float) -> pb.ExplainResponse:
    """What one step held (Explain); a control message, bounded as Describe's."""
    try:
      return self._explain(request, timeout=timeout_s, metadata=self._metadata)
    except grpc.RpcError as e:
      if _over_limit(e):
        raise BadReplyError(f"{self._name} sent an Explain answer over "
                            f"{MAX_CONTROL_MESSAGE_BYTES} bytes (refused unread)") from e
      raise _grpc_error(e) from e

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int, expect: Sequence[LeafSpec] | None = None,
             positions_of: str | None = None) -> Steps:
    """See `Connection.stream`. gRPC receives a message whole before this
    sees it: the channel's limit bounds that, this checks the exact one."""
    where = self._name
    call = self._get_batches(request, timeout=timeout_s, metadata=self._metadata)
    token.attach(call)
    index = 0
    try:
      for payload in call:
        yield decode_step(payload, request, index, max_frame_bytes, expect, where,
                          positions_of=positions_of)
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
