"""Page-locked receive buffers, on a machine without a GPU: a stand-in
`HostMemory` that records every block it hands out and every block freed
goes through the same interface as cudaHostAlloc and torch's pinned
allocator (client/transport/host_memory.py), so the pool's use of it, the
recycling, the choice of memory and the fallbacks are checked on every run."""

from __future__ import annotations

import gc
import importlib.util
import threading
import weakref

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from grain_elevator.client import RemoteDataset, TransportOptions, to_device
from grain_elevator.client import device as device_lib
from grain_elevator.client.transport import host_memory
from grain_elevator.client.transport.buffers import BufferPool
from helpers import assert_trees_equal, oracle_batch

# Rows a step of each "forever", for frames the pool keeps (buffers._MIN_POOLED_BYTES):
G = 2048  # the conftest's: 64 B rows, 131 KB frames
BIG_G = 32  # big_rows': 3 KiB rows, ~97 KiB frames (1/60 of the records to decode)


class _Block:
  """Owns one recorded allocation, as host_memory._Block owns CUDA memory."""

  def __init__(self, data: np.ndarray):
    self.__array_interface__ = data.__array_interface__
    self.data = data


class RecordingMemory:
  """Page-locked memory as far as the client can tell: it records where each
  block lies and when it is freed (once no array refers to it)."""

  name = "recording"
  page_locked = True

  def __init__(self, fail: bool = False):
    self.blocks: list[tuple[int, int]] = []  # (address, size) of each allocation
    self.freed: list[int] = []  # addresses, as their blocks went away
    self._fail = fail
    self._lock = threading.Lock()

  def allocate(self, nbytes: int) -> np.ndarray:
    if self._fail:
      raise host_memory.AllocationError("no page-locked memory left (on purpose)")
    block = _Block(np.empty(nbytes, dtype=np.uint8))
    address = block.data.ctypes.data
    with self._lock:
      self.blocks.append((address, nbytes))
    weakref.finalize(block, self._free, address)
    return np.asarray(block)

  def _free(self, address: int) -> None:
    with self._lock:
      self.freed.append(address)

  def holds(self, a: np.ndarray) -> bool:
    start = a.__array_interface__["data"][0]
    return any(b <= start and start + a.nbytes <= b + n for b, n in self.blocks)


def _bulk(server, memory, g: int = BIG_G) -> RemoteDataset:
  ds = RemoteDataset(server.target, "forever", g, prefetch=8,
                     transport=TransportOptions(kind="bulk"))
  ds.host_memory = memory
  return ds


def test_batches_land_in_the_given_memory_exactly_and_its_blocks_are_recycled(server, oracle):
  """Every leaf of 40 steps lies in a recorded block and equals embedded
  mode's; the blocks are lent again (far fewer than the steps); once the
  dataset is closed and its batches dropped, every block is freed. On the
  conftest's rows: with big_rows' (steps made and checked 60 times faster)
  13 blocks were lent now and then."""
  memory = RecordingMemory()
  with _bulk(server, memory, G) as ds:
    it = iter(ds)
    for k in range(40):
      batch = next(it)
      for key, leaf in batch.items():
        assert memory.holds(leaf), f"step {k} {key!r} is not in page-locked memory"
      assert_trees_equal(batch, oracle_batch(oracle, "forever", k, G), f"step {k}")
    assert 0 < len(memory.blocks) <= 8 + 4, f"{len(memory.blocks)} blocks for 40 steps"
    it.close()
  del it, batch, leaf
  gc.collect()
  assert sorted(memory.freed) == sorted(b for b, _ in memory.blocks)


def test_a_block_under_a_held_batch_is_never_lent_again(big_server, big_oracle):
  """A trainer (or a copy still in flight) holding a batch keeps its block:
  the held batches stay intact while the others' blocks are recycled."""
  memory = RecordingMemory()
  held = {}
  with _bulk(big_server, memory) as ds:
    it = iter(ds)
    for k in range(30):
      batch = next(it)
      if k % 5 == 0:
        held[k] = batch
    it.close()
  for k, batch in held.items():
    assert_trees_equal(batch, oracle_batch(big_oracle, "forever", k, BIG_G), f"held step {k}")


def test_without_page_locked_memory_the_pool_falls_back_to_ordinary(big_server, big_oracle):
  memory = RecordingMemory(fail=True)
  with _bulk(big_server, memory) as ds:
    it = iter(ds)
    for k in range(5):
      assert_trees_equal(next(it), oracle_batch(big_oracle, "forever", k, BIG_G), f"step {k}")
    it.close()
  assert not memory.blocks


def test_only_pooled_buffers_are_page_locked():
  """Small frames, and frames past the pool's bounds, get ordinary memory:
  page-locking is for buffers that are recycled."""
  memory = RecordingMemory()
  pool = BufferPool(max_buffers=2, memory=memory)
  small = pool.take(1000)
  assert not memory.holds(small)
  held = [pool.take(1 << 20) for _ in range(3)]  # all alive: the third is over the bounds
  assert [memory.holds(b) for b in held] == [True, True, False]
  assert len(memory.blocks) == 2 and pool.unpooled == 1


def test_page_locked_memory_is_chosen_for_gpus_only():
  fake = RecordingMemory()
  assert host_memory.for_platforms(["cpu"], cuda=lambda: fake) is None
  assert host_memory.for_platforms(["tpu", "cpu"], cuda=lambda: fake) is None
  assert host_memory.for_platforms(["gpu"], cuda=lambda: fake) is fake
  # A GPU without a page-locked allocator: ordinary memory, as before.
  assert host_memory.for_platforms(["gpu"], cuda=lambda: None) is None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_without_cuda_there_is_no_page_locked_memory_to_have():
  import torch  # pylint: disable=g-import-not-at-top
  if torch.cuda.is_available():
    pytest.skip("this machine has CUDA")
  assert host_memory.torch_pinned_memory() is None
  assert host_memory.cuda_host_memory() is None


def test_to_device_on_cpus_leaves_the_memory_as_it_was(server):
  mesh = jax.make_mesh((8,), ("data",))
  with RemoteDataset(server.target, "aug2", 96) as remote:
    next(iter(to_device(remote, NamedSharding(mesh, P("data")))))
    assert remote.host_memory is None


def test_the_users_choice_of_memory_stands():
  fake, other = RecordingMemory(), RecordingMemory()
  ds = RemoteDataset("127.0.0.1:1", "forever", G)
  device_lib.receive_page_locked(ds, fake)
  assert ds.host_memory is fake
  device_lib.receive_page_locked(ds, other)  # set already: kept
  assert ds.host_memory is fake
  device_lib.receive_page_locked([1, 2], fake)  # not a RemoteDataset: left alone
