"""The gRPC transport: Describe, GetBatches, Skip and Explain, adapted to the request path.

What a call costs before its request has arrived is bounded, whatever the
peer does (the bulk port's rules, server/serving/bulk.py, in gRPC's terms):

  * authentication runs in an interceptor on the call's metadata, for every
    service, health's included (probes go to the health port, which needs
    no secret): a missing or wrong token is refused before the request
    message is read, on a handler that never waits for it; each call that
    carried the token tells the front door its peer, and a connection that
    carried none is closed soon after it opens (server/serving/front_door.py);
  * every method is served as a stream-request handler, so a handler thread
    waits for the first request message only until REQUEST_ARRIVAL_TIMEOUT_S
    after the call's headers came (`Arrivals`); a call whose message never
    comes is cancelled and its thread freed. (A unary handler holds its
    thread until the whole message has arrived: 24 header-only calls used
    to take every thread of a worker.) The wire is the same as unary's, so
    any gRPC client calls the methods as elevator.proto declares them;
  * the message itself is at most MAX_REQUEST_BYTES (gRPC's receive limit),
    and connections and streams per connection are capped (server/process/worker.py).

Admission, validation and status mapping are the request path's
(server/serving/request_path.py). A failed call carries its error class in trailing
metadata, so the client raises the very type the server raised.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import message as protobuf_message

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.serving import front_door
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.request_path import RequestPath

log = logging.getLogger("grain_elevator.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Elevator"].full_name
# gRPC clients send a unary call's headers and its message in one write; a
# second is far more than any of them needs, even on a loaded host, and a
# burst of header-only calls then delays others by about that much.
REQUEST_ARRIVAL_TIMEOUT_S = 1.0
_ARRIVAL_CHECK_S = 0.05
# What a call taken up past its arrival deadline gets to read a message that
# is already there: a few watchdog periods (one caught it with 38 of 400
# over-limit calls on a loaded machine, cut CANCELLED instead of refused).
LATE_GRACE_S = 4 * _ARRIVAL_CHECK_S
_LOG_PERIOD_S = 10.0


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


class Arrivals:
  """Cancels calls whose first request message has not come within
  `timeout_s` of their headers, from one watchdog thread (a timer per call
  would be a thread per call). The clock starts when the call arrives
  (`ArrivalInterceptor`), not when a thread picks it up, so calls queued
  behind header-only ones are not cut short and those are freed at once."""

  def __init__(self, timeout_s: float = REQUEST_ARRIVAL_TIMEOUT_S):
    self.timeout_s = timeout_s
    self._lock = threading.Lock()
    self._due: list[tuple[float, int]] = []
    # Only calls still waiting are referenced: a context kept alive keeps its
    # call, whose HTTP/2 stream then still counts against the connection's
    # MAX_CONCURRENT_STREAMS.
    self._waiting: dict[int, grpc.ServicerContext] = {}
    self._ids = itertools.count()
    self._log = Throttled(_LOG_PERIOD_S)
    threading.Thread(target=self._watch, name="elevator-arrivals", daemon=True).start()

  def first(self, requests: Iterator[Any], context: grpc.ServicerContext,
            arrived: float) -> Any:
    """next(requests), the call cancelled if that takes past `arrived` +
    timeout_s (grpc.RpcError is then raised). A call a thread takes up only
    after that (it waited for one) gets LATE_GRACE_S to read what has
    arrived, which the watchdog would otherwise race."""
    key = next(self._ids)
    deadline = max(arrived + self.timeout_s, time.monotonic() + LATE_GRACE_S)
    with self._lock:
      self._waiting[key] = context
      heapq.heappush(self._due, (deadline, key))
    try:
      return next(requests)
    finally:
      with self._lock:
        self._waiting.pop(key, None)

  def _watch(self) -> None:
    while True:
      time.sleep(_ARRIVAL_CHECK_S)
      now = time.monotonic()
      late = []
      with self._lock:
        while self._due and self._due[0][0] <= now:
          _, key = heapq.heappop(self._due)
          context = self._waiting.pop(key, None)
          if context is not None:
            late.append(context)
      for context in late:
        metrics.current().error(grpc.StatusCode.CANCELLED.name)
        self._log.warning("arrival", "cancelled a call whose request message did not "
                          "arrive within %gs of its headers", self.timeout_s)
        context.cancel()


class _FirstOnTime:
  """A call's request iterator whose first message is awaited under the
  arrival deadline; a call cut for it (or cancelled by its client) ends the
  iteration, as an empty request stream would."""

  def __init__(self, requests: Iterator[Any], context: grpc.ServicerContext,
               arrivals: Arrivals, arrived: float):
    self._requests, self._context = requests, context
    self._arrivals, self._arrived = arrivals, arrived
    self._first = True

  def __iter__(self) -> "_FirstOnTime":
    return self

  def __next__(self) -> Any:
    try:
      if self._first:
        self._first = False
        return self._arrivals.first(self._requests, self._context, self._arrived)
      return next(self._requests)
    except grpc.RpcError:
      raise StopIteration from None


class ArrivalInterceptor(grpc.ServerInterceptor):
  """Notes when each call arrives and serves it under the arrival deadline.
  Every method this server registers reads its requests as a stream (a
  unary handler would hold its thread until the message arrived, out of
  reach of any deadline). `own_pools` gives methods by prefix a thread pool
  of their own (reflection: a client that idles on its stream holds only
  those)."""

  def __init__(self, arrivals: Arrivals,
               own_pools: dict[str, futures.ThreadPoolExecutor] | None = None):
    self._arrivals = arrivals
    self._own_pools = own_pools or {}

  def intercept_service(self, continuation, handler_call_details):
    arrived = time.monotonic()
    handler = continuation(handler_call_details)
    if handler is None or not handler.request_streaming:
      return handler
    streaming = handler.response_streaming
    inner = handler.stream_stream if streaming else handler.stream_unary
    arrivals = self._arrivals

    def behavior(requests: Iterator[Any], context: grpc.ServicerContext, *send: Any) -> Any:
      return inner(_FirstOnTime(requests, context, arrivals, arrived), context, *send)
    pool = next((p for prefix, p in self._own_pools.items()
                 if handler_call_details.method.startswith(prefix)),
                getattr(inner, "experimental_thread_pool", None))
    behavior.experimental_thread_pool = pool  # type: ignore[attr-defined]
    # A non-blocking stream (health's Watch) is handed its send callback.
    behavior.experimental_non_blocking = getattr(  # type: ignore[attr-defined]
        inner, "experimental_non_blocking", False)
    kind = (grpc.stream_stream_rpc_method_handler if streaming
            else grpc.stream_unary_rpc_method_handler)
    return kind(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def first_request(requests: Iterator[bytes], context: grpc.ServicerContext,
                  message: type[protobuf_message.Message]) -> Any:
  """The call's one request message, parsed as `message`; None if the call
  is over without it (cut by the arrival deadline, or cancelled by its
  client). Parsed here, not by gRPC: its parse failure in a request stream
  logs a traceback per call and leaves the call's stream open."""
  try:
    raw = next(requests)
  except StopIteration:
    if not context.is_active():
      return None
    _abort(context, errors.InvalidRequestError("the call ended without a request message"))
    raise  # not reached: abort raises
  try:
    return message.FromString(raw)
  except protobuf_message.DecodeError as e:
    _abort(context, errors.InvalidRequestError(
        f"the request is not a {message.DESCRIPTOR.full_name}: {e}"))
    raise  # not reached: abort raises


def bearer_token(metadata: Any) -> str | None:
  """The token of `authorization: Bearer <token>` metadata, if any."""
  got = dict(metadata or ()).get("authorization", "")
  if isinstance(got, bytes):
    got = got.decode(errors="replace")
  scheme, _, token = got.partition(" ")
  return token if scheme == "Bearer" else None


def _token(context: grpc.ServicerContext) -> str | None:
  return bearer_token(context.invocation_metadata())


class GrpcService:
  """The Elevator service of one worker."""

  def __init__(self, path: RequestPath):
    self._path = path

  def Describe(self, requests: Iterator[pb.DescribeRequest],
               context: grpc.ServicerContext) -> pb.DescribeResponse:
    request = first_request(requests, context, pb.DescribeRequest)
    if request is None:
      return pb.DescribeResponse()  # the call is over: never sent
    with _answering(context), self._path.admitted(_token(context)) as ticket:
      return self._path.describe_response(ticket, request)

  def GetBatches(self, requests: Iterator[pb.BatchRequest],
                 context: grpc.ServicerContext) -> Iterator[bytes]:
    """Yields serialized `Batch` messages (see `add_to_server`)."""
    request = first_request(requests, context, pb.BatchRequest)
    if request is None:
      return
    admitted = self._path.admitted(_token(context), context.cancel, steps=request.num_steps)
    with _answering(context), admitted as ticket:
      recorded = metrics.current()
      for parts in self._path.encoded_steps(ticket, request, context.is_active):
        message = b"".join(parts)
        recorded.sent(request.dataset, "grpc", len(message))
        with ticket.waiting():  # gRPC sends it while this generator is suspended
          yield message


  def Skip(self, requests: Iterator[pb.BatchRequest],
           context: grpc.ServicerContext) -> pb.SkipResponse:
    """A stream dataset's position after the steps asked for, none sent."""
    request = first_request(requests, context, pb.BatchRequest)
    if request is None:
      return pb.SkipResponse()  # the call is over: never sent
    admitted = self._path.admitted(_token(context), context.cancel, steps=request.num_steps)
    with _answering(context), admitted as ticket:
      return self._path.skip(ticket, request, context.is_active)


  def Explain(self, requests: Iterator[pb.ExplainRequest],
              context: grpc.ServicerContext) -> pb.ExplainResponse:
    """Where each row of a host's slice of one step came from, or counts
    per source over steps (JSON)."""
    request = first_request(requests, context, pb.ExplainRequest)
    if request is None:
      return pb.ExplainResponse()  # the call is over: never sent
    with _answering(context), self._path.admitted(_token(context)) as ticket:
      return self._path.explain(ticket, request, context.is_active)


def _pass_through(message: bytes) -> bytes:
  return message


def add_to_server(service: GrpcService, server: grpc.Server) -> None:
  """Registers the Elevator service; GetBatches sends pre-encoded bytes.

  Same methods and messages as the generated `add_ElevatorServicer_to_server`,
  but served as stream-request handlers (see the module docstring), and
  batches skip protobuf object construction (one copy of the tensor data
  instead of three).
  """
  handlers = {
      "Describe": grpc.stream_unary_rpc_method_handler(
          service.Describe,
          request_deserializer=None,  # bytes: first_request parses them
          response_serializer=pb.DescribeResponse.SerializeToString),
      "Explain": grpc.stream_unary_rpc_method_handler(
          service.Explain,
          request_deserializer=None,
          response_serializer=pb.ExplainResponse.SerializeToString),
      "Skip": grpc.stream_unary_rpc_method_handler(
          service.Skip,
          request_deserializer=None,
          response_serializer=pb.SkipResponse.SerializeToString),
      "GetBatches": grpc.stream_stream_rpc_method_handler(
          service.GetBatches,
          request_deserializer=None,
          response_serializer=_pass_through),
  }
  server.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _refusal(handler: grpc.RpcMethodHandler, error: errors.ElevatorError
             ) -> grpc.RpcMethodHandler:
  """A handler that answers `error` at once: request-streaming whatever the
  method's shape, so gRPC runs it without waiting for the request message,
  which it never reads."""
  def abort(request_iterator: Any, context: grpc.ServicerContext) -> Any:
    del request_iterator
    _abort(context, error)

  kind: Callable[..., grpc.RpcMethodHandler] = (
      grpc.stream_stream_rpc_method_handler if handler.response_streaming
      else grpc.stream_unary_rpc_method_handler)
  return kind(abort, request_deserializer=lambda _: b"",  # never parsed
              response_serializer=handler.response_serializer)


def _noting(handler: grpc.RpcMethodHandler, note: Callable[[str], None]
            ) -> grpc.RpcMethodHandler:
  """`handler`, telling `note` its call's peer (`context.peer()`) as a
  thread takes the call up, before it waits for the request message."""
  streams = (handler.request_streaming, handler.response_streaming)
  name, kind = {
      (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
      (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
      (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
      (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
  }[streams]
  inner = getattr(handler, name)

  def behavior(request: Any, context: grpc.ServicerContext, *send: Any) -> Any:
    note(context.peer())
    return inner(request, context, *send)
  for attr in ("experimental_thread_pool", "experimental_non_blocking"):
    if hasattr(inner, attr):
      setattr(behavior, attr, getattr(inner, attr))
  return kind(behavior, request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
  """Requires `authorization: Bearer <token>` metadata, checked by the
  request path, on every call (health's too: probes belong on the health
  port). Its `door` hears the peer of each call that carried it; the worker
  starts the door once its port is bound."""

  def __init__(self, path: RequestPath):
    self._path = path
    self.door = front_door.FrontDoor()

  def intercept_service(self, continuation, handler_call_details):
    try:
      self._path.authenticate(bearer_token(handler_call_details.invocation_metadata))
    except errors.UnauthenticatedError as e:
      handler = continuation(handler_call_details)
      return None if handler is None else _refusal(handler, e)
    handler = continuation(handler_call_details)
    return None if handler is None else _noting(handler, self.door.note)
