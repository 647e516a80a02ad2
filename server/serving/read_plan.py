"""Reads by plan: a request's steps, and the chunks this worker will be
asked for next, read from buckets before anyone asks.

What host h of H receives for step k is a pure function of the config, G,
h, H and k (proto/contract.py), so the records of any step are known in
advance. Clients cut their requests at multiples of their size n (chunk c
is steps [c*n, (c+1)*n)) and send chunk c to the worker that owns it
(client/transport/slots.py's `owner_of`), which is a function of c, the
replicas and the workers alone: a worker that serves chunk c of a host's
reading will be asked for chunk c + s next, where s, its *stride*, is the
number of workers of all the replicas (W with one replica). So on each request a
worker plans, in order, the request's own steps (all their ranges go out at
once, not a step at a time), then the steps of its next AHEAD_CHUNKS
chunks: server/data/storage/read_ahead.py fetches what they need within
its byte budget (`--read-ahead-mb`), and the reads of those steps take it
when the requests come. Step datasets plan here (step_shape.py); a stream
dataset's head plans its own reads (server/data/streams/head_reads.py).

How far ahead: at least AHEAD_CHUNKS chunks, and as many more as a read
asked for now needs to be back before its step is asked for. A reader's
requests reach this worker every `interval` seconds (measured), and a read
takes up to the horizon (storage/latency.py: twice the p99 of recent reads
plus the p95 after which a straggler is asked again), so the plan reaches
ceil(horizon / interval) + 1 chunks ahead (at most MAX_AHEAD_CHUNKS and
MAX_STEPS steps, within the byte budget): Little's law, requests in flight
= rate x latency, kept by planning, not by a fixed depth.

The stride is learned per reader (a dataset, G, host and offset) from the
chunks a worker is asked for (the difference between the last two), and
starts at the number of workers of this server (one replica). A guess that
is wrong costs bytes, never exactness: what no request takes is dropped after
read_ahead.STALE_S, and `elevator_storage_fetched_bytes_total` against
`elevator_storage_needed_bytes_total` shows it (docs/operations.md).
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from typing import Callable, Hashable, Iterable

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server.data.step_dataset import StepDataset
from grain_elevator.server.data.storage import objects
from grain_elevator.server.data.storage import read_ahead

# Chunks planned beyond the request's own: the next chunk this worker owns
# comes when the client's window moves past the chunks of every other
# worker, so two cover the wait with one to spare.
AHEAD_CHUNKS = 2
# Chunks planned ahead at most, however slow the bucket.
MAX_AHEAD_CHUNKS = 64
# Steps one request plans at most (a request may ask for
# thousands): planning costs a moment per step, and the budget bounds the bytes.
MAX_STEPS = 512
# Readers (dataset, fingerprint, G, host, offset, request size) whose
# stride is kept.
MAX_READERS = 4096


class ReadPlanner:
  """One worker's planner (thread-safe: `_lock` guards the strides)."""

  def __init__(self, num_workers: int = 1):
    self._num_workers = max(1, num_workers)
    self._lock = threading.Lock()
    # reader -> (last chunk asked for, stride, when, seconds between its
    # requests or None), least recently used first.
    self._readers: collections.OrderedDict[
        Hashable, tuple[int, int, float, float | None]] = collections.OrderedDict()

  def _stride(self, reader: Hashable, chunk: int, now: float) -> tuple[int, float | None]:
    """(stride, seconds between this reader's requests here, smoothed)."""
    with self._lock:
      last, stride, at, interval = self._readers.pop(
          reader, (None, self._num_workers, now, None))
      if last is not None and chunk > last:
        stride = chunk - last
        interval = now - at if interval is None else 0.7 * interval + 0.3 * (now - at)
        at = now
      self._readers[reader] = (max(chunk, last if last is not None else chunk), stride, at,
                               interval)
      while len(self._readers) > MAX_READERS:
        self._readers.popitem(last=False)
      return stride, interval

  def steps_to_plan(self, r: pb.BatchRequest, stream_length: int, drop_remainder: bool,
                    reader: Hashable, horizon_s: float = 0.0,
                    now: float | None = None) -> list[int]:
    """The request's steps, then those of the chunks this worker is
    expected to be asked for next, as many as `horizon_s` needs (at least
    AHEAD_CHUNKS), within the dataset's steps. A request that does
    not start at a multiple of its size (a resumed client's first, cut to
    the next multiple) gives no chunk: only its own steps are planned."""
    n = max(1, r.num_steps)
    end = contract.total_steps(stream_length, r.global_batch_size, r.record_offset,
                               drop_remainder)
    steps = list(range(r.start_step, min(r.start_step + n, end, r.start_step + MAX_STEPS)))
    if r.start_step % n or n > MAX_STEPS // (AHEAD_CHUNKS + 1):
      return steps  # no chunk, or a request for many steps: its own first steps only
    chunk = r.start_step // n
    stride, interval = self._stride((*reader, n), chunk,
                                    time.monotonic() if now is None else now)
    ahead = AHEAD_CHUNKS
    if interval and horizon_s > 0:
      ahead = min(MAX_AHEAD_CHUNKS, max(ahead, math.ceil(horizon_s / interval) + 1))
    for j in range(1, ahead + 1):
      first = (chunk + j * stride) * n
      if first >= end or len(steps) >= MAX_STEPS:
        break
      steps += range(first, min(first + n, end, first + MAX_STEPS - len(steps)))
    return steps

  @staticmethod
  def _reader(info: DatasetInfo, r: pb.BatchRequest) -> tuple[Hashable, ...]:
    """Whose steps `r` asks for: the same for every request of one host's
    reading."""
    return (info.name, info.config_fingerprint, r.global_batch_size, r.shard_index,
            r.shard_count, r.record_offset)

  @classmethod
  def _tag(cls, info: DatasetInfo, r: pb.BatchRequest, step: int) -> Hashable:
    """A step's group in the read-ahead: the same for every request of it."""
    return (*cls._reader(info, r), step)

  def plan(self, ds: StepDataset, r: pb.BatchRequest,
           made: Callable[[int], bool] = lambda step: False) -> int:
    """Plans the reads of `r`'s steps and the next chunks' (a dataset with
    nothing in buckets plans nothing), but not those of the steps `made`
    says are made already (the batch cache's). Returns the groups planned now."""
    info = ds.info
    needs_of = ds.read_needs
    ahead = read_ahead.current()
    if ahead.budget_bytes <= 0 or needs_of(r.start_step, r.global_batch_size, r.shard_index,
                                           r.shard_count, r.record_offset) is None:
      return 0  # off, or nothing of this dataset is in a bucket
    reader = self._reader(info, r)
    groups = []
    horizon_s = objects.objects().latency.horizon_s()
    for step in self.steps_to_plan(r, info.stream_length, info.drop_remainder, reader,
                                   horizon_s):
      tag = (*reader, step)
      if not ahead.planned(tag) and not made(step):
        groups.append((tag, needs_of(step, r.global_batch_size, r.shard_index, r.shard_count,
                                     r.record_offset)))
    return ahead.plan(info.name, groups)

  def release(self, ds: StepDataset, r: pb.BatchRequest, steps: Iterable[int]) -> None:
    """These steps of `r` are made (or will not be, by this request): what
    was read ahead for them is let go of."""
    ahead = read_ahead.current()
    if not ahead.holds_groups:
      return
    for step in itertools.islice(steps, MAX_STEPS):  # a request planned no more
      ahead.release(self._tag(ds.info, r, step))
