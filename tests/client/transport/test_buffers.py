"""Receive buffers are reused only once the trainer has let go of a batch."""

from __future__ import annotations

import numpy as np

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.client.transport.buffers import PAGE, BufferPool
from helpers import assert_trees_equal, oracle_batch

MB = 1 << 20


def _address(a: np.ndarray) -> int:
  return a.__array_interface__["data"][0]


def test_a_buffer_is_lent_again_only_when_no_view_of_it_lives():
  pool = BufferPool()
  first = pool.take(MB)
  a = _address(first)
  assert a % PAGE == 0 and len(first) == MB
  view = np.frombuffer(memoryview(first)[100:200], dtype=np.uint8)
  del first
  second = pool.take(MB)
  b = _address(second)
  assert b != a  # `view` still holds the first buffer
  del second
  assert _address(pool.take(MB)) == b
  del view
  # Both free now; frames grow by a byte now and then and still fit.
  assert _address(pool.take(MB + 7)) in (a, b)


def test_the_pool_holds_no_more_than_its_byte_cap():
  pool = BufferPool(max_bytes=8 * MB)
  kept = [pool.take(3 * MB) for _ in range(5)]  # all alive: at most two fit the cap
  assert pool.pooled_bytes <= 8 * MB
  del kept
  assert pool.pooled_bytes <= 8 * MB


def test_held_batches_are_intact_while_dropped_ones_buffers_are_reused(big_server,
                                                                       big_oracle):
  """A trainer keeps every third batch (a replay buffer) and drops the rest;
  the dropped ones' buffers come back for later steps, the kept ones are
  never written over. 32 rows of 3 KiB make each frame large enough to be
  pooled (conftest's big_rows)."""
  g = 32
  kept, addresses = {}, []
  with RemoteDataset(big_server.target, "forever", g, prefetch=8,
                     transport=TransportOptions(kind="bulk")) as ds:
    it = iter(ds)
    for k in range(45):
      batch = next(it)
      assert batch["image"].nbytes >= 96 << 10  # a pooled frame
      addresses.append(_address(batch["image"]))
      if k % 3 == 0:
        kept[k] = batch
  for k, batch in kept.items():
    assert_trees_equal(batch, oracle_batch(big_oracle, "forever", k, g), f"kept step {k}")
  # The scenario did hand memory of dropped batches to later ones.
  assert len(set(addresses)) < len(addresses), "no receive buffer was ever reused"
  kept_addresses = [addresses[k] for k in kept]
  assert len(set(kept_addresses)) == len(kept_addresses)
