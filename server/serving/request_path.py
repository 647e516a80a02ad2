"""The request path: every request, whichever way it came, goes through here.

gRPC (grpc_service.py), the bulk transport (bulk.py) and embedded mode
(client/embedded.py) are thin adapters around one `RequestPath`, so the
rules live once, and hold by construction: an answer is produced only for
a `Ticket`, and only `admit` issues one, after authenticating.

  1. authenticate: the bearer token, checked before any per-request work
     (gRPC also checks it from a call's metadata before reading the
     message, with `authenticate`);
  2. admit: at most `max_concurrent` requests at once over every transport
     (RESOURCE_EXHAUSTED beyond; UNAVAILABLE once the server is stopping);
     requests whose client does not read yield their slot (admission.py);
  3. validate: dataset, fingerprint, geometry, steps, compression, and the
     batch size limit, all before a record is read;
  4. plan the reads from buckets of the request's steps and of the chunks
     this worker will be asked for next (read_plan.py), then produce each
     step's rows (errors name the dataset and step), or take the encoded
     step from the worker's cache of steps served lately, which trainers
     reading the same stream share (batch_cache.py);
  5. map errors to statuses: every failure leaves as an `ElevatorError`,
     whose class and code the transports send (proto/errors.py).

Requests themselves are bounded before they are parsed, by the transports:
proto/limits.py's MAX_REQUEST_BYTES.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from typing import Any, Callable, Iterator, Protocol

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire
from grain_elevator.proto.errors import (InvalidRequestError, ShardChangedError,
                                         StreamMismatchError, UnauthenticatedError)
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server.data.registry import Dataset
from grain_elevator.server.data.registry import Datasets
from grain_elevator.server.data.streams import cancellation
from grain_elevator.server.data.streams.stream import StreamDataset
from grain_elevator.server.data.streams.sub_streams import SubStreams
from grain_elevator.server.serving.options import (DEFAULT_MAX_MESSAGE_BYTES,
                                                   DEFAULT_MAX_STREAM_BATCH_BYTES)
from grain_elevator.server.serving.admission import Admission, Ticket
from grain_elevator.server.serving.batch_cache import BatchCache
from grain_elevator.server.serving.read_plan import ReadPlanner
from grain_elevator.server.serving import step_errors
from grain_elevator.server.serving.step_shape import StepShape
from grain_elevator.server.serving.stream_sessions import StreamSessions
from grain_elevator.server.serving.stream_shape import StreamShape


class Shape(Protocol):
  """How the request path serves one kind of dataset (step_shape.py,
  stream_shape.py): the checks of its own, its steps, a skip, an explanation."""

  def check(self, ds: Any, r: pb.BatchRequest) -> None: ...
  def steps(self, ds: Any, r: pb.BatchRequest, is_active: Callable[[], bool]
            ) -> Iterator[tuple[int, list[Any], str]]: ...
  def encoded_steps(self, ds: Any, r: pb.BatchRequest, is_active: Callable[[], bool]
                    ) -> Iterator[list[Any]]: ...
  def skip(self, ds: Any, r: pb.BatchRequest, is_active: Callable[[], bool]
           ) -> pb.SkipResponse: ...
  def explain(self, ds: Any, r: pb.BatchRequest) -> Any: ...
  def summary(self, ds: Any, r: pb.BatchRequest, is_active: Callable[[], bool]) -> Any: ...


class RequestPath:
  """One worker's (or one embedded backend's) way from a request to batches."""

  def __init__(self, datasets: Datasets, *, auth_token: str | None = None,
               max_concurrent: int | None = None,
               max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
               max_stream_batch_bytes: int = DEFAULT_MAX_STREAM_BATCH_BYTES,
               write_timeout_s: float | None = None,
               server_info: pb.ServerInfo | None = None, batch_cache_bytes: int = 0):
    self.datasets = datasets
    self.cache = BatchCache(batch_cache_bytes)
    # Stream datasets' global batches, shared by their hosts (the same budget).
    self.streams = StreamSessions(batch_cache_bytes)
    self.server_info = server_info or pb.ServerInfo(num_workers=1)
    self.planner = ReadPlanner(self.server_info.num_workers)
    self.admission = Admission(max_concurrent, write_timeout_s=write_timeout_s)
    self._expected_token = auth_token.encode() if auth_token else None
    self._max_message_bytes = max_message_bytes
    self._step_shape = StepShape(self.cache, self.planner)
    self._stream_shape = StreamShape(self.streams, max_stream_batch_bytes)

  def shape(self, ds: Dataset) -> Shape:
    """The one place the request path tells the two kinds apart."""
    return (self._stream_shape if isinstance(ds, (StreamDataset, SubStreams))
            else self._step_shape)

  # 1. authentication -------------------------------------------------------

  def authenticate(self, token: str | None) -> None:
    """Raises UnauthenticatedError unless `token` is the server's (compared
    in constant time; never logged)."""
    if self._expected_token is None:
      return
    if not token:
      raise UnauthenticatedError(
          "missing bearer token: this server requires one (authorization metadata "
          "'Bearer <token>' over gRPC, auth_token over the bulk transport)")
    if not hmac.compare_digest(token.encode(), self._expected_token):
      raise UnauthenticatedError("wrong bearer token")

  # 2. admission -------------------------------------------------------------

  def admit(self, token: str | None, cancel: Callable[[], None] | None = None, *,
            steps: int = 1) -> Ticket:
    """A ticket for one request of `steps` steps, once its token is the
    server's and a slot is free (admission.py); a typed error otherwise.
    `cancel` ends the request from another thread (a client not reading);
    without one it is never cancelled (Describe). Release it when done."""
    self.authenticate(token)
    return self.admission.acquire(cancel, steps=steps)

  @contextlib.contextmanager
  def admitted(self, token: str | None, cancel: Callable[[], None] | None = None, *,
               steps: int = 1) -> Iterator[Ticket]:
    """`admit`, released on leaving."""
    ticket = self.admit(token, cancel, steps=steps)
    try:
      yield ticket
    finally:
      ticket.release()

  # 3. validation -------------------------------------------------------------

  def validate(self, r: pb.BatchRequest) -> Dataset:
    """The dataset that serves `r`; a typed error unless every step can be
    served within the limits."""
    ds = self.datasets.get(r.dataset)
    info = ds.info
    if r.config_fingerprint and r.config_fingerprint != info.config_fingerprint:
      raise StreamMismatchError(
          f"dataset {info.name!r}: the client expects config fingerprint "
          f"{r.config_fingerprint}, this server has {info.config_fingerprint}; "
          "replicas must share one config")
    contract.check_geometry(r.global_batch_size, r.shard_index, r.shard_count)
    rows = r.global_batch_size // r.shard_count
    batch_bytes = rows * info.element_spec.record_bytes
    if batch_bytes > self._max_message_bytes:
      raise InvalidRequestError(
          f"dataset {info.name!r}: {rows} rows of {info.element_spec.record_bytes} "
          f"bytes is {batch_bytes} bytes per step, over the server's "
          f"--max-message-bytes of {self._max_message_bytes}; use a smaller "
          "global_batch_size or more shards")
    self.shape(ds).check(ds, r)
    if r.compression not in wire.COMPRESSIONS.values():
      raise InvalidRequestError(f"unknown compression {r.compression}")
    return ds

  # 4. answers ----------------------------------------------------------------

  def describe(self, ticket: Ticket, request: pb.DescribeRequest) -> list[DatasetInfo]:
    _check(ticket)
    if request.global_batch_size < 0:
      raise InvalidRequestError(
          f"global_batch_size must be >= 0, got {request.global_batch_size}")
    if request.dataset:
      return [self.datasets.get(request.dataset).info]
    infos = []
    for name in self.datasets.names:
      try:
        infos.append(self.datasets.get(name).info)
      except ShardChangedError:  # refused on this worker: asked by name, it says why
        continue
    return infos

  def describe_response(self, ticket: Ticket,
                        request: pb.DescribeRequest) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        datasets=[i.to_proto(request.global_batch_size) for i in self.describe(ticket, request)],
        server=self.server_info)

  def steps(self, ticket: Ticket, r: pb.BatchRequest,
            is_active: Callable[[], bool] = lambda: True
            ) -> Iterator[tuple[int, list[Any], str]]:
    """(step, leaves, next_stream_state) for each step of `r`, in order,
    until `is_active()` is False (embedded mode); the state is "" but for a
    stream dataset."""
    _check(ticket)
    ds = self.validate(r)
    yield from step_errors.each_serving(_batches_of(r), self.shape(ds).steps(ds, r, is_active))

  def encoded_steps(self, ticket: Ticket, r: pb.BatchRequest,
                    is_active: Callable[[], bool] = lambda: True) -> Iterator[list[Any]]:
    """Each step of `r` as the buffers of one serialized Batch (the servers'
    send path): from the cache when a request served it lately."""
    _check(ticket)
    ds = self.validate(r)
    yield from step_errors.each_serving(_batches_of(r),
                                        self.shape(ds).encoded_steps(ds, r, is_active))

  def skip(self, ticket: Ticket, r: pb.BatchRequest,
           is_active: Callable[[], bool] = lambda: True) -> pb.SkipResponse:
    """A stream dataset's position after steps [start, start+num) of `r`,
    from r.stream_state, with none of them sent (Skip; at most
    MAX_SKIP_ROWS // G). EndOfDataError if the stream ends first."""
    _check(ticket)
    ds = self.validate(r)
    with step_errors.serving(f"a skip over {_batches_of(r)}"):  # one that kills is remembered
      return self.shape(ds).skip(ds, r, is_active)

  def explain(self, ticket: Ticket, e: pb.ExplainRequest,
              is_active: Callable[[], bool] = lambda: True) -> pb.ExplainResponse:
    """Where each row of host h's slice of global batch start_step came
    from (server/data/provenance.py), as JSON; validated as a request for
    that one step is. With `summary`, counts per source over the request's
    whole global batches instead."""
    _check(ticket)
    r = e.request
    if not e.summary and r.num_steps != 1:
      raise InvalidRequestError(f"Explain covers one step: num_steps must be 1, got "
                                f"{r.num_steps}")
    ds = self.validate(r)
    shape = self.shape(ds)
    what = "a summary" if e.summary else "an explanation"
    with (cancellation.producing_for(is_active),  # stops within an element or a chunk
          step_errors.serving(f"{what} of {_batches_of(r)}")):  # one that kills is remembered
      explained = shape.summary(ds, r, is_active) if e.summary else shape.explain(ds, r)
    return pb.ExplainResponse(json=json.dumps(explained, separators=(",", ":")))


def _batches_of(r: pb.BatchRequest) -> str:
  """What, beside its dataset and step, tells a step of `r` from another
  (step_errors.serving): the rows it holds."""
  offset = f", record offset {r.record_offset}" if r.record_offset else ""
  return (f"batches of global_batch_size {r.global_batch_size}, host {r.shard_index} "
          f"of {r.shard_count}{offset}")


def _check(ticket: Ticket) -> None:
  if not isinstance(ticket, Ticket):
    raise TypeError(f"a request is answered for a Ticket from RequestPath.admit, not "
                    f"{type(ticket).__name__}")
