"""The batch cache on its own: a byte bound on the memory its entries keep
alive, least recently used out first, and one producer per step however
many requests want it at once."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc

import numpy as np
import pytest

from grain_elevator.pipelines import RowStack
from grain_elevator.proto import wire

from grain_elevator.server.serving.batch_cache import BatchCache, held_bytes
from traced import traced


def _parts(n: int, fill: int = 0) -> list:
  return [b"\x08\x01", memoryview(np.full(n, fill, np.uint8))]


def test_hit_returns_the_same_buffers_without_producing():
  cache = BatchCache(1 << 20)
  made = []
  first, hit = cache.get("k", lambda: made.append(1) or _parts(100))
  assert not hit
  again, hit = cache.get("k", lambda: made.append(1) or _parts(100))
  assert hit and again is first and made == [1]


def test_bytes_stay_under_the_budget_least_recently_used_out_first():
  cache = BatchCache(3 * 1002)  # three entries of 1,002 bytes
  for k in "abc":
    cache.get(k, lambda: _parts(1000))
  cache.get("a", lambda: pytest.fail("a is cached"))  # a is now the most recent
  cache.get("d", lambda: _parts(1000))  # evicts b, the least recent
  assert cache.bytes == 3 * 1002 and len(cache) == 3
  made = []
  for k in "bac":  # b was evicted; its return evicts c (then the least recent)
    cache.get(k, lambda k=k: made.append(k) or _parts(1000))
  assert made == ["b", "c"]
  assert cache.bytes <= cache.max_bytes


def test_an_entry_over_the_whole_budget_is_served_not_kept():
  cache = BatchCache(500)
  cache.get("small", lambda: _parts(100))
  parts, hit = cache.get("big", lambda: _parts(1000))
  assert not hit and held_bytes(parts) == 1002
  assert len(cache) == 1 and cache.bytes == 102


def test_zero_keeps_nothing():
  cache = BatchCache(0)
  made = []
  for _ in range(2):
    cache.get("k", lambda: made.append(1) or _parts(10))
  assert made == [1, 1] and cache.bytes == 0


def test_concurrent_requests_for_one_step_produce_it_once():
  cache = BatchCache(1 << 20)
  started, release = threading.Event(), threading.Event()
  calls = []

  def produce():
    calls.append(1)
    started.set()
    release.wait(10)
    return _parts(10, fill=7)

  results = []
  threads = [threading.Thread(target=lambda: results.append(cache.get("k", produce)))
             for _ in range(4)]
  threads[0].start()
  assert started.wait(10)
  for t in threads[1:]:
    t.start()
  time.sleep(0.2)  # the others are waiting, not producing
  assert calls == [1]
  release.set()
  for t in threads:
    t.join(10)
  assert calls == [1] and len(results) == 4
  assert sorted(hit for _, hit in results) == [False, True, True, True]
  assert len({id(parts) for parts, _ in results}) == 1


def test_a_failed_producer_lets_a_waiter_produce_and_raises_only_its_own():
  cache = BatchCache(1 << 20)
  started, release = threading.Event(), threading.Event()

  def failing():
    started.set()
    release.wait(10)
    raise RuntimeError("bad record")

  errors, got = [], []

  def first():
    try:
      cache.get("k", failing)
    except RuntimeError as e:
      errors.append(e)

  t1 = threading.Thread(target=first)
  t1.start()
  assert started.wait(10)
  t2 = threading.Thread(target=lambda: got.append(cache.get("k", lambda: _parts(5))))
  t2.start()
  time.sleep(0.1)
  release.set()
  t1.join(10)
  t2.join(10)
  assert len(errors) == 1 and got and got[0][1] is False
  assert len(cache) == 1


def test_a_waiter_gives_up_after_wait_s_and_produces_itself():
  cache = BatchCache(1 << 20, wait_s=0.2)
  started, release = threading.Event(), threading.Event()

  def stuck():  # until the waiter has returned: only giving up lets it
    started.set()
    release.wait(60)
    return _parts(5)

  t = threading.Thread(target=lambda: cache.get("k", stuck))
  t.start()
  assert started.wait(10)
  _, hit = cache.get("k", lambda: _parts(5))
  assert not hit and t.is_alive(), "the waiter waited for the stuck producer"
  release.set()
  t.join(10)


# Rows that are views of bigger records keep the records alive: the budget
# counts the records.

RECORD_BYTES, ROW_BYTES, ROWS = 1 << 20, 16 << 10, 4


def _step_of_views(step: int) -> list:
  """An encoded step whose rows are small views of big records: a RowStack
  of row views (as a whole-batch decode makes) and a memoryview of a slice."""
  records = [np.full(RECORD_BYTES, step, np.uint8) for _ in range(ROWS)]
  rows = RowStack([r[100:100 + ROW_BYTES] for r in records])
  label = np.arange(RECORD_BYTES // 8, dtype=np.int64)[:ROWS]
  return wire.encode_batch_parts(step, [rows, label])


def test_views_are_charged_for_the_records_they_keep_alive():
  parts = _step_of_views(1)
  sent = sum(memoryview(p).nbytes for p in parts)
  assert sent < ROWS * ROW_BYTES + 1024  # what goes out: the views
  # What stays in memory: every record once, the label's whole array, the headers.
  assert ROWS * RECORD_BYTES + RECORD_BYTES <= held_bytes(parts) < (ROWS + 1) * RECORD_BYTES + 1024
  # A buffer shown by several parts counts once.
  record = np.zeros(RECORD_BYTES, np.uint8)
  assert held_bytes([memoryview(record[:10]), memoryview(record[10:20]).cast("B"),
                     np.frombuffer(memoryview(record)[5:], np.uint8)]) == RECORD_BYTES
  raw = bytes(RECORD_BYTES)
  assert held_bytes([memoryview(np.frombuffer(raw, np.uint8, 10, offset=16))]) == RECORD_BYTES


def _memory_held_by_a_full_cache(budget: int) -> int:
  """Memory still allocated after 20 steps went through a cache of `budget`
  and the producer dropped its references (run under tracemalloc)."""
  cache = BatchCache(budget)
  for step in range(20):
    cache.get(step, lambda step=step: _step_of_views(step))
    assert cache.bytes <= budget
  gc.collect()
  held = tracemalloc.get_traced_memory()[0]
  del cache
  return held


def test_the_budget_bounds_the_memory_entries_keep_alive():
  """Steps of views, each sending ~64 KiB and keeping ~5 MiB alive, through a
  cache of 12 MiB: two stay, least recently used out first, and the memory
  still allocated once the producer dropped its references is within budget
  (counted in a fresh interpreter: tests/traced.py)."""
  budget = 12 << 20
  held, _, _ = traced(_memory_held_by_a_full_cache, budget)
  assert held < budget + (1 << 20), f"{held / 2**20:.1f} MiB alive for a {budget >> 20} MiB cache"
  cache = BatchCache(budget)
  for step in range(20):
    cache.get(step, lambda step=step: _step_of_views(step))
  assert len(cache) == 2 and cache.bytes > 2 * ROWS * RECORD_BYTES
  cache.get(19, lambda: pytest.fail("step 19 is cached"))
  cache.get(18, lambda: pytest.fail("step 18 is cached"))
  made = []
  cache.get(17, lambda: made.append(17) or _step_of_views(17))  # evicted: made again
  assert made == [17] and len(cache) == 2
