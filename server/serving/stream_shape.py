"""How the request path serves a stream dataset (server/data/streams/stream.py):
steps continue from a position (stream_state), each global batch made once
for all its hosts (stream_sessions.py), a skip fast-forwards without sending,
and rows and tokens are counted as they go. A stream of several sub-streams
(server/data/streams/sub_streams.py) is served a sub-stream per request, as
a stream of its own with G/N rows (`part_of`). Its sibling is step_shape.py;
request_path.py picks one per dataset and calls nothing else of either."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire
from grain_elevator.proto.errors import Cancelled, EndOfDataError, InvalidRequestError
from grain_elevator.proto import limits
from grain_elevator.proto.limits import MAX_SKIP_ROWS, MAX_SKIP_STEPS
from grain_elevator.server.data.streams import cancellation
from grain_elevator.server.data import provenance
from grain_elevator.server.data.streams import stream as stream_lib
from grain_elevator.server.data.streams.stream import StreamDataset
from grain_elevator.server.data.streams.sub_streams import SubStreams
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.stream_sessions import StreamSessions
from grain_elevator.server.serving.step_errors import failures, named, where

Step = tuple[int, list[np.ndarray], str]
Stream = StreamDataset | SubStreams  # one stream, or several (server/data/streams/sub_streams.py)


class StreamShape:
  """Steps of stream datasets: one per RequestPath, whose sessions it keeps."""

  def __init__(self, sessions: StreamSessions, max_stream_batch_bytes: int):
    self.sessions = sessions
    self._max_stream_batch_bytes = max_stream_batch_bytes

  def check(self, ds: Stream, r: pb.BatchRequest) -> None:
    info = ds.info
    _, g, _ = part_of(ds, r)
    global_bytes = g * info.element_spec.record_bytes
    if global_bytes > self._max_stream_batch_bytes:  # made whole, whatever rows are asked for
      made = ("global batches" if info.stream_shards == 1
              else f"sub-batches (G/{info.stream_shards} rows)")
      raise InvalidRequestError(
          f"dataset {info.name!r} is a stream dataset, whose {made} are made "
          f"whole: {g} rows of {info.element_spec.record_bytes} bytes "
          f"is {global_bytes} bytes, over the server's --max-stream-batch-bytes of "
          f"{self._max_stream_batch_bytes}; use a smaller global_batch_size")
    contract.check_steps(r.start_step, r.num_steps, info.stream_length,
                         r.global_batch_size, r.record_offset, info.drop_remainder)
    if r.record_offset:
      raise InvalidRequestError(
          f"dataset {info.name!r} is a stream dataset: it continues from stream_state, "
          f"not from a record_offset ({r.record_offset})")

  def steps(self, whole: Stream, r: pb.BatchRequest,
            is_active: Callable[[], bool]) -> Iterator[Step]:
    """Host rows of global batches produced once for every host (of one
    sub-stream's sub-batches, for a stream of several). Fewer than asked
    if the stream ends, then EndOfDataError (OUT_OF_RANGE)."""
    ds, g, rows = part_of(whole, r)
    name = ds.info.name
    batches = self.sessions.batches(ds, g, _start(ds, r), r.num_steps,
                                    (r.shard_count, r.shard_index), is_active)
    recorded = metrics.current()
    step = r.start_step
    at = where(name, step)  # a position is shown once it is the server's own
    try:
      while True:
        began = time.perf_counter()
        try:
          got = named(name, at, next, batches, None)
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
          _account(ds, host)
        yield step, host, state
        step += 1
        at = where(name, step, state)
    finally:
      batches.close()  # its session is released now, not when collected
    if step < r.start_step + r.num_steps and is_active():
      raise EndOfDataError(f"dataset {name!r}: the stream ends before step {step} "
                           f"(asked for steps up to {r.start_step + r.num_steps - 1})")

  def encoded_steps(self, ds: Stream, r: pb.BatchRequest,
                    is_active: Callable[[], bool]) -> Iterator[list[Any]]:
    for step, leaves, state in self.steps(ds, r, is_active):
      yield wire.encode_batch_parts(step, leaves, r.compression, state)

  def skip(self, whole: Stream, r: pb.BatchRequest,
           is_active: Callable[[], bool]) -> pb.SkipResponse:
    """The position after steps [start, start+num) of `r` (of its
    sub-stream, for a stream of several), with none of them sent (at most
    limits.skip_steps(G): MAX_SKIP_ROWS rows, or one step).
    EndOfDataError if the stream ends first."""
    ds, g, _ = part_of(whole, r)
    name = ds.info.name
    if r.num_steps > MAX_SKIP_STEPS:
      raise InvalidRequestError(
          f"dataset {name!r}: a Skip moves at most {MAX_SKIP_STEPS} steps per call, "
          f"asked for {r.num_steps}; split it")
    most = limits.skip_steps(g)
    if r.num_steps > most:
      raise InvalidRequestError(
          f"dataset {name!r}: a Skip computes at most {MAX_SKIP_ROWS} rows per call "
          f"(MAX_SKIP_ROWS), {most} steps of {_rows_label(whole)}={g}; asked for "
          f"{r.num_steps} steps ({r.num_steps * g} rows): split it (the client does)")
    start = _start(ds, r)
    with cancellation.producing_for(is_active):
      done, position = named(name, where(name, r.start_step, start), ds.fast_forward,
                             g, start, r.num_steps)
    if done < r.num_steps and whole.info.stream_shards > 1 and not whole.info.drop_remainder:
      # Evaluation mode: this sub-stream pads from its end while others go on.
      return pb.SkipResponse(next_step=r.start_step + r.num_steps,
                             next_stream_state=position, stream_ended=True)
    if done < r.num_steps:
      raise EndOfDataError(
          f"dataset {name!r}: a skip of {r.num_steps} steps from step {r.start_step} "
          f"passes the end of the stream, which ends after step {r.start_step + done - 1}")
    return pb.SkipResponse(next_step=r.start_step + r.num_steps, next_stream_state=position)

  def explain(self, whole: Stream, r: pb.BatchRequest) -> Any:
    """Traced from the position where the step starts, stopped when the
    request the caller produces for goes (cancellation.producing_for); of a
    stream of several, the sub-batch of the sub-stream `r` names, this
    host's rows of it (the client merges the sub-streams')."""
    ds, _, _ = part_of(whole, r)
    name = ds.info.name
    start = _start(ds, r)
    return named(name, where(name, r.start_step, start), provenance.explain_stream, ds,
                 r.global_batch_size, r.shard_index, r.shard_count, r.start_step, start,
                 cancellation.check, stream_shard=r.stream_shard,
                 stream_shards=whole.info.stream_shards)

  def summary(self, whole: Stream, r: pb.BatchRequest,
              is_active: Callable[[], bool]) -> Any:
    """Every step of the range traced from the position where it starts
    (at most MAX_STREAM_SUMMARY_ROWS rows), stopped when the caller goes;
    of a stream of several, the sub-batches of the sub-stream `r` names."""
    ds, _, _ = part_of(whole, r)
    name = ds.info.name
    start = _start(ds, r)
    with cancellation.producing_for(is_active):
      return named(name, where(name, r.start_step, start), provenance.summary_stream, ds,
                   r.start_step, r.num_steps, r.global_batch_size, start, cancellation.check,
                   stream_shard=r.stream_shard, stream_shards=whole.info.stream_shards)


def part_of(ds: Stream, r: pb.BatchRequest) -> tuple[StreamDataset, int, range]:
  """What `r` reads: the stream, or the sub-stream it names; the rows of
  its batches (G, or G/N); and the rows of each that are this host's
  (proto/contract.py). InvalidRequestError if it reads the stream as
  another number of sub-streams than the dataset has."""
  info = ds.info
  n, asked = info.stream_shards, max(1, r.stream_shards)
  if asked != n:
    has = f"{n} sub-streams" if n > 1 else "one stream (no sub-streams)"
    raise InvalidRequestError(
        f"dataset {info.name!r} is {has}, and this request reads it as {asked} "
        "(stream_shards): describe it again (its config changed, or this client "
        "predates sub-streams)")
  if n == 1:
    if r.stream_shard:
      raise InvalidRequestError(f"dataset {info.name!r} has no sub-streams, and this request "
                                f"names sub-stream {r.stream_shard}")
    return ds, r.global_batch_size, contract.host_rows(
        r.global_batch_size, r.shard_index, r.shard_count)
  if not 0 <= r.stream_shard < n:
    raise InvalidRequestError(f"dataset {info.name!r}: stream_shard must be in [0, {n}), "
                              f"got {r.stream_shard}")
  contract.check_stream_shards(r.global_batch_size, n, info.name)
  return (ds.part(r.stream_shard), r.global_batch_size // n, contract.sub_stream_rows(
      r.global_batch_size, r.shard_index, r.shard_count, r.stream_shard, n))


def _rows_label(ds: Stream) -> str:
  """What a step's rows are called: G, or a sub-stream's G/N."""
  n = ds.info.stream_shards
  return "G" if n == 1 else f"G/{n}"


def _start(ds: StreamDataset, r: pb.BatchRequest) -> str:
  """The position `r` starts from: its stream_state, checked, or the stream's start."""
  name = ds.info.name
  if not r.stream_state:
    return ds.info.stream_start
  try:
    return stream_lib.parse_position(r.stream_state, ds.info.stream_start, name)
  except InvalidRequestError as e:
    failures.warning((name, "position"), "%s", e)
    raise


def _account(ds: StreamDataset, leaves: list[np.ndarray]) -> None:
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
