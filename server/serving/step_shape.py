"""How the request path serves a step dataset (1:1 or a mixture: any step
found in O(1), server/data/step_dataset.py): its reads planned from buckets, each
step made or taken from the batch cache, its records counted by mixture
component. Its sibling is stream_shape.py; request_path.py picks one per
dataset and calls nothing else of either."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire
from grain_elevator.proto.errors import InvalidRequestError
from grain_elevator.server.data import collate as collate_lib
from grain_elevator.server.data import provenance
from grain_elevator.server.data.step_dataset import StepDataset
from grain_elevator.server.data.streams import cancellation
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.batch_cache import BatchCache
from grain_elevator.server.serving.production_time import ProductionTimes
from grain_elevator.server.serving.read_plan import ReadPlanner
from grain_elevator.server.serving.step_errors import failures, named, where

Step = tuple[int, list[collate_lib.Leaf], str]


class StepShape:
  """Steps of datasets that answer for any step: one per RequestPath."""

  def __init__(self, cache: BatchCache, planner: ReadPlanner):
    self.cache = cache
    self.planner = planner
    self.times = ProductionTimes()  # said to clients that ask (report_production)

  def check(self, ds: StepDataset, r: pb.BatchRequest) -> None:
    ds.check_batch_size(r.global_batch_size)  # a scheduled mixture: G times its steps fit int64
    info = ds.info
    contract.check_steps(r.start_step, r.num_steps, info.stream_length,
                         r.global_batch_size, r.record_offset, info.drop_remainder)
    if r.stream_state:
      raise InvalidRequestError(
          f"dataset {info.name!r} is not a stream dataset: stream_state means nothing for it")

  def steps(self, ds: StepDataset, r: pb.BatchRequest,
            is_active: Callable[[], bool]) -> Iterator[Step]:
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

  def encoded_steps(self, ds: StepDataset, r: pb.BatchRequest,
                    is_active: Callable[[], bool]) -> Iterator[list[Any]]:
    info = ds.info
    stream = (info.name, info.config_fingerprint, r.global_batch_size, r.shard_index,
              r.shard_count, r.record_offset, r.compression)
    self._plan(ds, r, lambda step: self.cache.holds((*stream, step)))
    recorded = metrics.current()
    made = r.start_step
    try:
      for step in range(r.start_step, r.start_step + r.num_steps):
        if not is_active():
          return
        parts, cached = self.cache.get((*stream, step), lambda: wire.encode_batch_parts(
            step, self._produce(ds, r, step, stack=False), r.compression))
        if r.report_production:  # a new list: the cache's is shared
          parts = [*parts, wire.production_field(self.times.step_us(
              info.name, r.global_batch_size // r.shard_count))]
        made = self._made(ds, r, step)
        recorded.served(info.name, cached=cached)
        recorded.cache_bytes(self.cache.bytes)
        _account(ds, r, step)
        yield parts
    finally:
      self.planner.release(ds, r, range(made, r.start_step + r.num_steps))

  def skip(self, ds: StepDataset, r: pb.BatchRequest,
           is_active: Callable[[], bool]) -> pb.SkipResponse:
    del r, is_active
    raise InvalidRequestError(
        f"dataset {ds.info.name!r} is not a stream dataset: a client skips its steps in "
        "O(1), without asking a server")

  def explain(self, ds: StepDataset, r: pb.BatchRequest) -> Any:
    name = ds.info.name
    return named(name, where(name, r.start_step), provenance.explain, ds, r.start_step,
                 r.global_batch_size, r.shard_index, r.shard_count, r.record_offset)

  def summary(self, ds: StepDataset, r: pb.BatchRequest,
              is_active: Callable[[], bool]) -> Any:
    """Counted from the contract: arithmetic, nothing made, but up to
    MAX_SUMMARY_ROWS of it, so it stops between chunks once its request is
    gone (the request path runs it under cancellation.producing_for)."""
    del is_active
    name = ds.info.name
    return named(name, where(name, r.start_step), provenance.summary, ds, r.start_step,
                 r.num_steps, r.global_batch_size, r.record_offset, cancellation.check)

  def _plan(self, ds: StepDataset, r: pb.BatchRequest,
            made: Callable[[int], bool] = lambda step: False) -> None:
    """Plans the reads of `r`'s steps and the next chunks' (not of those
    `made`: the batch cache holds them); a failure to plan only costs the
    read-ahead (the steps read what they need)."""
    try:
      self.planner.plan(ds, r, made)
    except Exception:  # pylint: disable=broad-except
      failures.warning((ds.info.name, "plan"), "dataset %r: planning reads failed; reading "
                       "them when asked for", ds.info.name, exc_info=True)

  def _made(self, ds: StepDataset, r: pb.BatchRequest, step: int) -> int:
    """Step `step` of `r` is made: its read-ahead is let go of. Returns
    the first step not made yet (a request that ends early lets go of the
    rest: the callers' `finally`)."""
    self.planner.release(ds, r, [step])
    return step + 1

  def _produce(self, ds: StepDataset, r: pb.BatchRequest, step: int, *,
               stack: bool) -> list[collate_lib.Leaf]:
    """Step `step`'s leaves, timed; `stack=False` may leave big rows as
    RowStacks for the socket to gather."""
    start = time.perf_counter()
    leaves = named(ds.info.name, where(ds.info.name, step), ds.host_batch_leaves, step,
                   r.global_batch_size, r.shard_index, r.shard_count,
                   record_offset=r.record_offset, stack=stack)
    took = time.perf_counter() - start
    metrics.current().produced(ds.info.name, took)
    self.times.made(ds.info.name, r.global_batch_size // r.shard_count, took)
    return leaves


def _account(ds: StepDataset, r: pb.BatchRequest, step: int) -> None:
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
