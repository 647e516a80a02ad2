"""The gRPC transport: Describe and GetBatches, adapted to the request path.

Authentication runs in an interceptor, before a request is even parsed, for
every service but health (load balancers and kubelet probes need no
secret); admission, validation and status mapping are the request path's
(server/request_path.py). A failed call carries its error class in trailing
metadata, so the client raises the very type the server raised.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import grpc

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.server import metrics
from grain_elevator.server.request_path import RequestPath

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Elevator"].full_name
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _abort(context: grpc.ServicerContext, error: errors.ElevatorError) -> None:
  """Ends the call with the error's status code, message and class."""
  code, message, type_name = errors.status_of(error)
  metrics.current().error(code.name)
  context.set_trailing_metadata(((errors.ERROR_TYPE_KEY, type_name),))
  context.abort(code, message)


@contextlib.contextmanager
def _answering(context: grpc.ServicerContext) -> Iterator[None]:
  """Turns an ElevatorError raised inside into the call's status."""
  try:
    yield
  except errors.ElevatorError as e:
    _abort(context, e)


class GrpcService:
  """The Elevator service of one worker."""

  def __init__(self, path: RequestPath):
    self._path = path

  def Describe(self, request: pb.DescribeRequest,
               context: grpc.ServicerContext) -> pb.DescribeResponse:
    with _answering(context), self._path.admission():
      return self._path.describe_response(request)

  def GetBatches(self, request: pb.BatchRequest,
                 context: grpc.ServicerContext) -> Iterator[bytes]:
    """Yields serialized `Batch` messages (see `add_to_server`)."""
    admitted = self._path.admission(context.cancel, steps=request.num_steps)
    with _answering(context), admitted as ticket:
      recorded = metrics.current()
      for parts in self._path.encoded_steps(request, context.is_active):
        message = b"".join(parts)
        recorded.sent(request.dataset, "grpc", len(message))
        with ticket.waiting():  # gRPC sends it while this generator is suspended
          yield message


def _pass_through(message: bytes) -> bytes:
  return message


def add_to_server(service: GrpcService, server: grpc.Server) -> None:
  """Registers the Elevator service; GetBatches sends pre-encoded bytes.

  Same methods and messages as the generated `add_ElevatorServicer_to_server`,
  but batches skip protobuf object construction (one copy of the tensor data
  instead of three).
  """
  handlers = {
      "Describe": grpc.unary_unary_rpc_method_handler(
          service.Describe,
          request_deserializer=pb.DescribeRequest.FromString,
          response_serializer=pb.DescribeResponse.SerializeToString),
      "GetBatches": grpc.unary_stream_rpc_method_handler(
          service.GetBatches,
          request_deserializer=pb.BatchRequest.FromString,
          response_serializer=_pass_through),
  }
  server.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _refusal(handler: grpc.RpcMethodHandler, error: errors.ElevatorError
             ) -> grpc.RpcMethodHandler:
  """A handler of the same shape that answers `error` without reading the request."""
  def abort(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
    del request_or_iterator
    _abort(context, error)

  kind: Callable[..., grpc.RpcMethodHandler]
  if handler.request_streaming and handler.response_streaming:
    kind = grpc.stream_stream_rpc_method_handler
  elif handler.request_streaming:
    kind = grpc.stream_unary_rpc_method_handler
  elif handler.response_streaming:
    kind = grpc.unary_stream_rpc_method_handler
  else:
    kind = grpc.unary_unary_rpc_method_handler
  return kind(abort, request_deserializer=lambda _: b"",  # never parsed
              response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
  """Requires `authorization: Bearer <token>` metadata, checked by the
  request path, on every service but health."""

  def __init__(self, path: RequestPath):
    self._path = path

  def intercept_service(self, continuation, handler_call_details):
    if handler_call_details.method.startswith(OPEN_PREFIXES):
      return continuation(handler_call_details)
    metadata = dict(handler_call_details.invocation_metadata or ())
    got = metadata.get("authorization", "")
    if isinstance(got, bytes):
      got = got.decode(errors="replace")
    scheme, _, token = got.partition(" ")
    try:
      self._path.authenticate(token if scheme == "Bearer" else None)
    except errors.UnauthenticatedError as e:
      handler = continuation(handler_call_details)
      return None if handler is None else _refusal(handler, e)
    return continuation(handler_call_details)
