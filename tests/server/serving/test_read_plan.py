"""ReadPlanner in-process: which steps a request plans (its own, then the
chunks this worker is asked for next, at the stride it learns), and the
groups it hands the read-ahead and lets go of. No server, no bucket."""

from __future__ import annotations

from typing import Any

import pytest

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data.registry import Datasets
from grain_elevator.server.data.storage import read_ahead
from grain_elevator.server.serving import read_plan
from grain_elevator.server.serving.read_plan import AHEAD_CHUNKS, MAX_STEPS, ReadPlanner

READER = ("ds", "fingerprint", 8, 0, 1, 0)  # what keys a reader's stride: name ... offset
LONG = 10**9  # records: a dataset whose end no plan reaches


def _request(start: int, num: int, g: int = 8, h: int = 0, n: int = 1) -> pb.BatchRequest:
  return pb.BatchRequest(dataset="ds", global_batch_size=g, shard_index=h, shard_count=n,
                         start_step=start, num_steps=num)


def _chunks(*ranges: tuple[int, int]) -> list[int]:
  return [s for a, b in ranges for s in range(a, b)]


def test_a_chunk_plans_itself_then_the_next_chunks_of_this_worker():
  """Chunk 2 of 4 steps on a server of 3 workers: this worker is asked for
  chunks 5 and 8 next."""
  assert AHEAD_CHUNKS == 2  # the table below spells out two chunks ahead
  planner = ReadPlanner(num_workers=3)
  assert planner.steps_to_plan(_request(8, 4), LONG, True, READER) == _chunks(
      (8, 12), (20, 24), (32, 36))


def test_the_stride_is_learned_per_reader_from_the_chunks_asked_for():
  planner = ReadPlanner(num_workers=3)
  planner.steps_to_plan(_request(0, 4), LONG, True, READER)
  # Asked for chunk 2 after chunk 0: two workers in all (another replica's
  # count, or fewer workers), so chunks 4 and 6 come next.
  assert planner.steps_to_plan(_request(8, 4), LONG, True, READER) == _chunks(
      (8, 12), (16, 20), (24, 28))
  other = (*READER[:3], 1, 2, 0)  # another host: its own stride, from the worker count
  assert planner.steps_to_plan(_request(8, 4, h=1, n=2), LONG, True, other) == _chunks(
      (8, 12), (20, 24), (32, 36))


def test_a_slow_bucket_is_planned_as_far_ahead_as_its_reads_take():
  """Little's law: a reader whose requests reach this worker every 0.1 s,
  against reads that take up to 0.55 s, is planned ceil(0.55 / 0.1) + 1 = 7
  chunks ahead; a fast one keeps AHEAD_CHUNKS; none passes MAX_AHEAD_CHUNKS."""
  planner = ReadPlanner(num_workers=2)
  planner.steps_to_plan(_request(0, 4), LONG, True, READER, 0.55, now=10.0)
  slow = planner.steps_to_plan(_request(8, 4), LONG, True, READER, 0.55, now=10.1)
  assert slow == _chunks((8, 12), *[((2 + 2 * j) * 4, (3 + 2 * j) * 4) for j in range(1, 8)])
  fast = planner.steps_to_plan(_request(16, 4), LONG, True, READER, 0.05, now=10.2)
  assert fast == _chunks((16, 20), (24, 28), (32, 36))
  far = planner.steps_to_plan(_request(24, 4), LONG, True, READER, 1000.0, now=10.3)
  assert len(far) == 4 * (1 + read_plan.MAX_AHEAD_CHUNKS)


@pytest.mark.parametrize("start,num,want", [
    (5, 4, _chunks((5, 9))),  # not at a multiple of its size (a resumed client's first)
    (0, MAX_STEPS // (AHEAD_CHUNKS + 1) + 1,  # a long stream's request: its own steps
     _chunks((0, MAX_STEPS // (AHEAD_CHUNKS + 1) + 1))),
    (0, MAX_STEPS + 50, _chunks((0, MAX_STEPS))),  # and at most MAX_STEPS of them
])
def test_what_plans_no_chunk_ahead(start, num, want):
  assert ReadPlanner(num_workers=2).steps_to_plan(_request(start, num), LONG, True,
                                                  READER) == want


@pytest.mark.parametrize("drop_remainder,want", [
    (True, _chunks((4, 8), (8, 9))),  # 75 records of 8: 9 whole steps
    (False, _chunks((4, 8), (8, 10))),  # evaluation mode: a 10th, padded
])
def test_nothing_past_the_stream_is_planned(drop_remainder, want):
  assert ReadPlanner(num_workers=1).steps_to_plan(_request(4, 4), 75, drop_remainder,
                                                  READER) == want


class _InBucket:
  """A step dataset whose records are in a bucket and whose steps need no
  byte beyond what is held (the needs of a real one are reads of objects)."""

  def __init__(self, info: Any):
    self.info = info
    self.asked: list[int] = []

  def read_needs(self, step: int, global_batch_size: int, shard_index: int,
                 shard_count: int, record_offset: int = 0) -> list[Any]:
    self.asked.append(step)
    return []


@pytest.fixture(scope="module")
def plain(config_path: str) -> Any:
  return Datasets(config_lib.load_config(config_path), open_now=False).get("plain")


@pytest.fixture
def ahead(monkeypatch) -> read_ahead.ReadAhead:
  """This process's read-ahead, fresh, with a budget; put back after."""
  fresh = read_ahead.ReadAhead(1 << 20)
  monkeypatch.setattr(read_ahead, "_current", fresh)
  return fresh


def test_a_dataset_on_local_disk_plans_nothing(plain, ahead):
  assert ReadPlanner(num_workers=2).plan(plain, _request(0, 4)) == 0
  assert not ahead.holds_groups


def test_each_planned_step_is_a_group_until_it_is_made(plain, ahead):
  ds = _InBucket(plain.info)  # 1000 records: 125 steps of 8
  planner = ReadPlanner(num_workers=2)
  r = _request(8, 4)
  steps = _chunks((8, 12), (16, 20), (24, 28))
  assert planner.plan(ds, r) == len(steps)
  assert sorted(set(ds.asked)) == steps
  assert planner.plan(ds, r) == 0  # planned already: nothing new
  planner.release(ds, r, steps[:4])  # the request's own steps, made
  assert planner.plan(ds, r) == 4  # those, planned again; the chunks ahead still are
  planner.release(ds, r, steps)
  assert not ahead.holds_groups


def test_no_budget_plans_nothing(plain, monkeypatch):
  monkeypatch.setattr(read_ahead, "_current", read_ahead.ReadAhead(0))
  ds = _InBucket(plain.info)
  assert ReadPlanner().plan(ds, _request(0, 4)) == 0
  assert not ds.asked  # not even asked what it needs


def test_steps_the_batch_cache_holds_are_not_planned(plain, ahead):
  """A step made already (another trainer's, in the batch cache) reads
  nothing: planning it would fetch bytes no step takes."""
  ds = _InBucket(plain.info)
  planner = ReadPlanner(num_workers=2)
  held = {9, 16, 17}
  assert planner.plan(ds, _request(8, 4), made=held.__contains__) == 12 - len(held)
  assert not held & set(ds.asked)
