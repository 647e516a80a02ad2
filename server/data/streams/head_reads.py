"""Reads by plan for the random-access head of a stream dataset in a bucket.

A stream's head, pipeline(records), is computed element by element, and an
element reads one record: from a bucket, one ranged GET each, one after
another, so a head of 20 ms requests made 50 elements a second whatever the
CPU. But which records the next elements read is known: head element i
reads record position i * len(records) // len(head) (i itself where the
pipeline keeps the length, a filter's holes included; i // fan_out behind
a flat_map), and a position's record is a pure function of the config
(the shuffle). So the head is read in blocks of BLOCK consecutive indices,
and each block's records are planned into the worker's read-ahead
(server/data/storage/read_ahead.py) at once, concurrently, before its
first element is computed:
- the parallel head (parallel_head.py) plans each task, whoever computes
  it, as the task starts (and its owner as it deals one to itself);
- a head in one process (embedded mode, a one-worker server) is a
  `PlannedHead`, which plans the block it enters and those after, as many
  as the bucket's measured latency needs at the rate blocks are computed.
A block is let go of once computed. A guess that is wrong (a pipeline that
reads other records) costs bytes, never exactness: the read fetches what
the read-ahead does not hold, and what nothing takes is dropped when stale.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Hashable

import grain

from grain_elevator.server.data.storage import objects
from grain_elevator.server.data.storage import read_ahead

# Consecutive head indices planned as one group: the parallel head's task.
BLOCK = 32
# Blocks a one-process head plans beyond the one it reads: at least
# BLOCKS_AHEAD, and as many as the bucket's reads take to come back at the
# rate the head is computed (Little's law: storage/latency.py's horizon over
# the seconds a block takes), at most MAX_BLOCKS_AHEAD.
BLOCKS_AHEAD = 2
MAX_BLOCKS_AHEAD = 32


def next_index(state: dict[str, Any], length: int) -> int:
  """The head position of a state {"next_index": i} (Grain's
  `to_iter_dataset()` state), checked against the head's length."""
  index = state["next_index"]
  if not isinstance(index, int) or not 0 <= index <= length:
    raise ValueError(f"next_index {index!r} is out of the head's range [0, {length}]")
  return index


class HeadReads:
  """Plans the bucket reads of blocks of one stream's head. Thread-safe
  (the read-ahead is)."""

  def __init__(self, dataset: str, fingerprint: str, head_length: int, records_length: int,
               record_needs: Callable[[list[int]], Any]):
    """`record_needs(positions)`: per object, the chunk extents the records
    at these record-stream positions need (ObjectRecordSource.needs)."""
    self._dataset = dataset
    self._fingerprint = fingerprint
    self._head_length = head_length
    self._records_length = records_length
    self._record_needs = record_needs

  def positions(self, start: int, count: int) -> list[int]:
    """The record positions head[start : start+count] read."""
    stop = min(start + count, self._head_length)
    n, m = self._records_length, max(1, self._head_length)
    return sorted({i * n // m for i in range(start, stop)})

  def plan(self, start: int, count: int) -> Hashable | None:
    """Plans the reads of head[start : start+count]; returns the group to
    `release` once computed (None: read-ahead off, or past its budget)."""
    ahead = read_ahead.current()
    if ahead.budget_bytes <= 0 or start >= self._head_length:
      return None
    tag = (self._dataset, self._fingerprint, "head", start, count)
    if not ahead.planned(tag) and not ahead.plan(
        self._dataset, [(tag, self._record_needs(self.positions(start, count)))]):
      return None
    return tag

  @staticmethod
  def release(tag: Hashable | None) -> None:
    if tag is not None:
      read_ahead.current().release(tag)


class PlannedHead(grain.IterDataset):
  """`head.to_iter_dataset()` in one process (the same elements and
  states), its records read by plan, a block at a time."""

  def __init__(self, head: grain.MapDataset, reads: HeadReads):
    super().__init__()
    self._head = head
    self._reads = reads

  def __iter__(self) -> grain.DatasetIterator:
    return _PlannedHeadIterator(self._head, self._reads)


class HeadIterator(grain.DatasetIterator):
  """What Grain's `head.to_iter_dataset()` iterator is: head[i] in order,
  the pipeline's None holes skipped, its state {"next_index": i}. A
  subclass says how element i is had (`_element`) and what a new position
  forgets (`_reset`)."""

  def __init__(self, head: grain.MapDataset):
    super().__init__()
    self._head = head
    self._next = 0  # the index after the last element returned

  def _element(self, index: int) -> Any:
    raise NotImplementedError

  def _reset(self) -> None:
    pass

  def __next__(self) -> Any:
    end = len(self._head)
    while self._next < end:
      element = self._element(self._next)
      self._next += 1
      if element is not None:
        return element
    raise StopIteration

  def get_state(self) -> dict[str, Any]:
    return {"next_index": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    self._next = next_index(state, len(self._head))
    self._reset()


class _PlannedHeadIterator(HeadIterator):

  def __init__(self, head: grain.MapDataset, reads: HeadReads):
    super().__init__(head)
    self._reads = reads
    self._block = -1
    self._planned: dict[int, Hashable | None] = {}  # block start -> its group
    self._entered_at: float | None = None  # when the last block was entered

  def _blocks_ahead(self) -> int:
    """BLOCKS_AHEAD, or more where a block is computed faster than the
    bucket answers."""
    now = time.monotonic()
    seconds, self._entered_at = (None if self._entered_at is None
                                 else now - self._entered_at), now
    if seconds is None or seconds <= 0:
      return BLOCKS_AHEAD
    horizon = objects.objects().latency.horizon_s()
    return min(MAX_BLOCKS_AHEAD, max(BLOCKS_AHEAD, math.ceil(horizon / seconds) + 1))

  def _enter(self, block: int) -> None:
    """Lets go of the blocks behind `block`; plans it and those after."""
    for start in [s for s in self._planned if s < block]:
      self._reads.release(self._planned.pop(start))
    for k in range(self._blocks_ahead() + 1):
      start = block + k * BLOCK
      if start not in self._planned and start < len(self._head):
        self._planned[start] = self._reads.plan(start, BLOCK)
    self._block = block

  def _element(self, index: int) -> Any:
    block = index - index % BLOCK
    if block != self._block:
      self._enter(block)
    return self._head[index]

  def _reset(self) -> None:
    self._block = -1
    self._entered_at = None
