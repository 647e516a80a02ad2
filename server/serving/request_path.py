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
import logging
import time
from typing import Any, Callable, Iterator

import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire
from grain_elevator.proto.errors import (Cancelled, DataLossError, ElevatorError,
                                         EndOfDataError, InvalidRequestError,
                                         ShardChangedError, StreamMismatchError,
                                         UnauthenticatedError)
from grain_elevator.proto.throttle import Throttled
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.proto.limits import MAX_SKIP_STEPS
from grain_elevator.server.data import cancellation
from grain_elevator.server.data import collate as collate_lib
from grain_elevator.server.data import provenance
from grain_elevator.server.data import stream as stream_lib
from grain_elevator.server.data.dataset import Datasets
from grain_elevator.server.data.served import ServedDataset
from grain_elevator.server.data.stream import StreamDataset
from grain_elevator.server.serving.options import (DEFAULT_MAX_MESSAGE_BYTES,
                                                   DEFAULT_MAX_STREAM_BATCH_BYTES)
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.admission import Admission, Ticket
from grain_elevator.server.serving.batch_cache import BatchCache
from grain_elevator.server.serving.read_plan import ReadPlanner
from grain_elevator.server.serving.stream_sessions import StreamSessions

log = logging.getLogger("grain_elevator.server")

# How much of a stream position an error message shows.
_POSITION_SHOWN = 200
# Failures come by the hundred when a client retries a bad request in a loop:
# one log line per period for each dataset and kind of failure.
_LOG_PERIOD_S = 10.0
_failures = Throttled(_LOG_PERIOD_S, log)


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
    self._max_stream_batch_bytes = max_stream_batch_bytes

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

  def validate(self, r: pb.BatchRequest) -> ServedDataset:
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
    if info.stream:  # a stream's batch is made whole, whatever rows are asked for
      global_bytes = r.global_batch_size * info.element_spec.record_bytes
      if global_bytes > self._max_stream_batch_bytes:
        raise InvalidRequestError(
            f"dataset {info.name!r} is a stream dataset, whose global batches are made "
            f"whole: {r.global_batch_size} rows of {info.element_spec.record_bytes} bytes "
            f"is {global_bytes} bytes, over the server's --max-stream-batch-bytes of "
            f"{self._max_stream_batch_bytes}; use a smaller global_batch_size")
    ds.check_batch_size(r.global_batch_size)  # a scheduled mixture: G times its steps fit int64
    contract.check_steps(r.start_step, r.num_steps, info.stream_length,
                         r.global_batch_size, r.record_offset, info.drop_remainder)
    if info.stream and r.record_offset:
      raise InvalidRequestError(
          f"dataset {info.name!r} is a stream dataset: it continues from stream_state, "
          f"not from a record_offset ({r.record_offset})")
    if r.stream_state and not info.stream:
      raise InvalidRequestError(
          f"dataset {info.name!r} is not a stream dataset: stream_state means nothing for it")
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
            ) -> Iterator[tuple[int, list[collate_lib.Leaf], str]]:
    """(step, leaves, next_stream_state) for each step of `r`, in order,
    until `is_active()` is False (embedded mode); the state is "" but for a
    stream dataset."""
    _check(ticket)
    ds = self.validate(r)
    if ds.info.stream:
      yield from self._stream_steps(ds, r, is_active)
      return
    self._plan(ds, r)
    made = r.start_step
    try:
      for step in range(r.start_step, r.start_step + r.num_steps):
        if not is_active():  # the client went away: stop computing
          return
        leaves = self._produce(ds, r, step, stack=True)
        made = self._made(ds, r, step)
        metrics.current().served(ds.info.name, cached=False)
        _account(ds, r, step)
        yield step, leaves, ""
    finally:
      self.planner.release(ds, r, range(made, r.start_step + r.num_steps))

  def encoded_steps(self, ticket: Ticket, r: pb.BatchRequest,
                    is_active: Callable[[], bool] = lambda: True) -> Iterator[list[Any]]:
    """Each step of `r` as the buffers of one serialized Batch (the servers'
    send path): from the cache when a request served it lately."""
    _check(ticket)
    ds = self.validate(r)
    info = ds.info
    if info.stream:
      for step, leaves, state in self._stream_steps(ds, r, is_active):
        yield wire.encode_batch_parts(step, leaves, r.compression, state)
      return
    stream = (info.name, info.config_fingerprint, r.global_batch_size, r.shard_index,
              r.shard_count, r.record_offset, r.compression)
    self._plan(ds, r)
    recorded = metrics.current()
    made = r.start_step
    try:
      for step in range(r.start_step, r.start_step + r.num_steps):
        if not is_active():
          return
        parts, cached = self.cache.get((*stream, step), lambda: wire.encode_batch_parts(
            step, self._produce(ds, r, step, stack=False), r.compression))
        made = self._made(ds, r, step)
        recorded.served(info.name, cached=cached)
        recorded.cache_bytes(self.cache.bytes)
        _account(ds, r, step)
        yield parts
    finally:
      self.planner.release(ds, r, range(made, r.start_step + r.num_steps))

  def _stream_steps(self, ds: StreamDataset, r: pb.BatchRequest,
                    is_active: Callable[[], bool]
                    ) -> Iterator[tuple[int, list[np.ndarray], str]]:
    """A stream dataset's steps from r.stream_state: host rows of global
    batches produced once for every host (stream_sessions.py). Fewer than
    asked if the stream ends, then EndOfDataError (OUT_OF_RANGE)."""
    name = ds.info.name
    start = ds.info.stream_start
    if r.stream_state:
      try:
        start = stream_lib.parse_position(r.stream_state, start, name)
      except InvalidRequestError as e:
        _failures.warning((name, "position"), "%s", e)
        raise
    batches = self.streams.batches(ds, r.global_batch_size, start, r.num_steps,
                                   (r.shard_count, r.shard_index), is_active)
    rows = contract.host_rows(r.global_batch_size, r.shard_index, r.shard_count)
    recorded = metrics.current()
    step = r.start_step
    where = _step(name, step)  # a position is shown once it is the server's own
    try:
      while True:
        began = time.perf_counter()
        try:
          got = _named(name, where, next, batches, None)
        except Cancelled:  # the request ended while its batch was being made
          return
        if got is None:
          break
        (leaves, state), produced = got
        if produced:
          recorded.produced(name, time.perf_counter() - began)
        recorded.served(name, cached=not produced)
        host = [a[rows.start:rows.stop] for a in leaves]
        if recorded.on:
          _account_stream(ds, host)
        yield step, host, state
        step += 1
        where = _step(name, step, state)
    finally:
      batches.close()  # its session is released now, not when collected
    if step < r.start_step + r.num_steps and is_active():
      raise EndOfDataError(f"dataset {name!r}: the stream ends before step {step} "
                           f"(asked for steps up to {r.start_step + r.num_steps - 1})")

  def skip(self, ticket: Ticket, r: pb.BatchRequest,
           is_active: Callable[[], bool] = lambda: True) -> pb.SkipResponse:
    """A stream dataset's position after steps [start, start+num) of `r`,
    from r.stream_state, with none of them sent (Skip; at most
    MAX_SKIP_STEPS). EndOfDataError if the stream ends first."""
    _check(ticket)
    ds = self.validate(r)
    name = ds.info.name
    if not ds.info.stream:
      raise InvalidRequestError(
          f"dataset {name!r} is not a stream dataset: a client skips its steps in O(1), "
          "without asking a server")
    if r.num_steps > MAX_SKIP_STEPS:
      raise InvalidRequestError(
          f"dataset {name!r}: a Skip moves at most {MAX_SKIP_STEPS} steps per call, "
          f"asked for {r.num_steps}; split it")
    start = ds.info.stream_start
    if r.stream_state:
      try:
        start = stream_lib.parse_position(r.stream_state, start, name)
      except InvalidRequestError as e:
        _failures.warning((name, "position"), "%s", e)
        raise
    with cancellation.producing_for(is_active):
      done, position = _named(name, _step(name, r.start_step, start), ds.fast_forward,
                              r.global_batch_size, start, r.num_steps)
    if done < r.num_steps:
      raise EndOfDataError(
          f"dataset {name!r}: a skip of {r.num_steps} steps from step {r.start_step} "
          f"passes the end of the stream, which ends after step {r.start_step + done - 1}")
    return pb.SkipResponse(next_step=r.start_step + r.num_steps, next_stream_state=position)

  def explain(self, ticket: Ticket, e: pb.ExplainRequest) -> pb.ExplainResponse:
    """Where each row of host h's slice of global batch start_step came
    from (server/data/provenance.py), as JSON; validated as a request for
    that one step is. With `summary`, the records per component of the
    request's whole global batches instead."""
    _check(ticket)
    r = e.request
    if e.summary:
      ds = self.validate(r)
      summary = _named(ds.info.name, _step(ds.info.name, r.start_step), provenance.summary,
                       ds, r.start_step, r.num_steps, r.global_batch_size, r.record_offset)
      return pb.ExplainResponse(json=json.dumps(summary, separators=(",", ":")))
    if r.num_steps != 1:
      raise InvalidRequestError(f"Explain covers one step: num_steps must be 1, got "
                                f"{r.num_steps}")
    ds = self.validate(r)
    name = ds.info.name
    if ds.info.stream:  # traced from the position where the step starts
      start = ds.info.stream_start
      if r.stream_state:
        start = stream_lib.parse_position(r.stream_state, start, name)
      explained = _named(name, _step(name, r.start_step, start), provenance.explain_stream,
                         ds, r.global_batch_size, r.shard_index, r.shard_count,
                         r.start_step, start)
      return pb.ExplainResponse(json=json.dumps(explained, separators=(",", ":")))
    explained = _named(name, _step(name, r.start_step), provenance.explain, ds, r.start_step,
                       r.global_batch_size, r.shard_index, r.shard_count, r.record_offset)
    return pb.ExplainResponse(json=json.dumps(explained, separators=(",", ":")))

  def _plan(self, ds: ServedDataset, r: pb.BatchRequest) -> None:
    """Plans the reads of `r`'s steps and the next chunks'; a failure to
    plan only costs the read-ahead (the steps read what they need)."""
    try:
      self.planner.plan(ds, r)
    except Exception:  # pylint: disable=broad-except
      _failures.warning((ds.info.name, "plan"), "dataset %r: planning reads failed; reading "
                        "them when asked for", ds.info.name, exc_info=True)

  def _made(self, ds: ServedDataset, r: pb.BatchRequest, step: int) -> int:
    """Step `step` of `r` is made: its read-ahead is let go of. Returns
    the first step not made yet (a request that ends early lets go of the
    rest: request_path's callers)."""
    self.planner.release(ds, r, [step])
    return step + 1

  @staticmethod
  def _produce(ds: ServedDataset, r: pb.BatchRequest, step: int, *,
               stack: bool) -> list[collate_lib.Leaf]:
    """Step `step`'s leaves; `stack=False` may leave big rows as RowStacks
    for the socket to gather."""
    start = time.perf_counter()
    leaves = _named(ds.info.name, _step(ds.info.name, step), ds.host_batch_leaves, step,
                    r.global_batch_size, r.shard_index, r.shard_count,
                    record_offset=r.record_offset, stack=stack)
    metrics.current().produced(ds.info.name, time.perf_counter() - start)
    return leaves

def _account(ds: ServedDataset, r: pb.BatchRequest, step: int) -> None:
  """Counts the records of host h's slice of `step` by mixture component
  (server/data/provenance.py), where metrics are kept."""
  recorded = metrics.current()
  if not recorded.on:
    return
  rows = contract.host_positions(step, r.global_batch_size, r.shard_index, r.shard_count,
                                 r.record_offset)
  for component, n in provenance.counts(ds, rows.start, rows.stop,
                                        r.global_batch_size).items():
    if component != "_padding":
      recorded.records_served(ds.info.name, component or ds.info.name, n)


def _account_stream(ds: StreamDataset, leaves: list[np.ndarray]) -> None:
  """A stream's host rows: its rows that are elements (the mask's, in
  evaluation mode), and its tokens (the segment ids' non-padding slots)."""
  recorded = metrics.current()
  name = ds.info.name
  paths = [l.path for l in ds.info.element_spec.leaves]
  rows = len(leaves[0]) if leaves else 0
  if contract.MASK_KEY in paths:
    rows = int(np.count_nonzero(leaves[paths.index(contract.MASK_KEY)]))
  recorded.records_served(name, name, rows)
  tokens = sum(int(np.count_nonzero(a)) for p, a in zip(paths, leaves)
               if p.endswith("segment_ids"))
  if tokens:
    recorded.tokens_served(name, name, tokens)


def _check(ticket: Ticket) -> None:
  if not isinstance(ticket, Ticket):
    raise TypeError(f"a request is answered for a Ticket from RequestPath.admit, not "
                    f"{type(ticket).__name__}")


def _named(dataset: str, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """`fn(...)`, its failure re-raised with `where` (the dataset and step)
  in front of its message: as the same ElevatorError class, or, for an
  exception from the pipeline, DATA_LOSS (this step's data cannot be made).
  A cancelled request is no failure. Logged at most once a period for each
  dataset and kind (the first with its traceback)."""
  try:
    return fn(*args, **kwargs)
  except Cancelled:
    raise
  except ElevatorError as e:  # e.g. DATA_LOSS naming the shard and record
    _failures.warning((dataset, type(e)), "%s: %s", where, e)
    raise type(e)(f"{where}: {e}") from e
  except Exception as e:  # pylint: disable=broad-except
    _failures.warning((dataset, type(e)), "%s failed", where, exc_info=True)
    raise DataLossError(f"{where}: {type(e).__name__}: {e}") from e


def _step(dataset: str, step: int, position: str | None = None) -> str:
  """Where a failure happened; a stream's position (JSON) is cut short."""
  where = f"dataset {dataset!r}, step {step}"
  if position is not None:
    where += f" (stream position {position[:_POSITION_SHOWN]}"
    where += "...)" if len(position) > _POSITION_SHOWN else ")"
  return where
