"""Connections spread evenly over a replica's worker processes, two per
worker by default, and chunks dealt over the workers of every replica."""

from __future__ import annotations

import collections
import time

import pytest

from grain_elevator.client import TransportOptions
from grain_elevator.client.transport.pool import ConnectionPool
from grain_elevator.client.transport.options import RetryPolicy
from grain_elevator.client.transport.slots import Slot, Slots, owner_of
from grain_elevator.client.window import REQUESTS_PER_WORKER
from grain_elevator.proto import elevator_pb2 as pb


@pytest.fixture(scope="module")
def second(serve):
  """Another replica, of 3 workers."""
  return serve(workers=3)


def _pool(targets, per_target: int, kind: str = "auto") -> ConnectionPool:
  return ConnectionPool(targets, transport=TransportOptions(
      kind=kind, connections_per_target=per_target))


def _grpc_workers(pool: ConnectionPool) -> collections.Counter:
  """Each data channel asked afresh which worker holds it."""
  return collections.Counter(
      s.conn.describe(pb.DescribeRequest(dataset="plain"), timeout_s=10).server.worker_index
      for s in pool.data_slots())


def _bulk_workers(pool: ConnectionPool) -> collections.Counter:
  return collections.Counter((s.conn.target, s.conn.server.worker_index)
                             for s in pool.data_slots())


@pytest.mark.parametrize("per_target", [1, 2, 4])
def test_grpc_channels_cover_every_worker_evenly(server, per_target):
  pool = _pool([server.target], per_target, "grpc")
  try:
    pool.describe("plain", 16)  # G: the batch connections open
    share = -(-per_target // 2)
    assert _grpc_workers(pool) == {0: share, 1: share}
    assert not pool.uses_bulk
  finally:
    pool.close()


@pytest.mark.parametrize("per_target", [1, 2, 4])
def test_bulk_connections_cover_every_worker_evenly(server, per_target):
  """Where bulk connections carry the batches, they are the ones balanced;
  one gRPC channel per target is kept for Describe."""
  pool = _pool([server.target], per_target)
  try:
    pool.describe("plain", 16)  # G: the batch connections open
    share = -(-per_target // 2)
    assert _bulk_workers(pool) == {(server.target, 0): share, (server.target, 1): share}
    assert pool.num_connections == 1
  finally:
    pool.close()


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_every_replica_gets_its_share(server, second, transport):
  pool = _pool([server.target, second.target], 3, transport)
  try:
    pool.describe("plain", 16)  # G: the batch connections open
    # 2 workers x 2 (ceil(3/2)) + 3 workers x 1
    if transport == "grpc":
      assert pool.num_connections == 7 + 2  # and one per target, for Describe
    else:
      assert pool.num_connections == 2  # one channel per target, for Describe
      counts = _bulk_workers(pool)
      assert counts == {**{(server.target, w): 2 for w in range(2)},
                        **{(second.target, w): 1 for w in range(3)}}, counts
  finally:
    pool.close()


def test_a_default_pool_opens_two_connections_per_worker(server):
  """connections_per_target None: REQUESTS_PER_WORKER on each worker, as
  many as the replica says it has."""
  pool = ConnectionPool([server.target])
  try:
    pool.describe("plain", 16)
    assert _bulk_workers(pool) == {(server.target, 0): REQUESTS_PER_WORKER,
                                   (server.target, 1): REQUESTS_PER_WORKER}
    assert pool.parallelism == 2 * REQUESTS_PER_WORKER
  finally:
    pool.close()


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_replicas_of_different_sizes_get_connections_for_their_workers(server, second,
                                                                        transport):
  pool = ConnectionPool([server.target, second.target],
                        transport=TransportOptions(kind=transport))
  try:
    pool.describe("plain", 16)
    assert pool.parallelism == REQUESTS_PER_WORKER * (2 + 3)
    if transport == "auto":
      assert _bulk_workers(pool) == {
          **{(server.target, w): REQUESTS_PER_WORKER for w in range(2)},
          **{(second.target, w): REQUESTS_PER_WORKER for w in range(3)}}
  finally:
    pool.close()


class _Conn:
  """What owner_of reads of a connection: its replica and its worker (and
  Slots its capacity, a bulk connection's)."""

  capacity = 1

  def __init__(self, target: str, worker: int, workers: int):
    self.target = self.host = target
    self.server = pb.ServerInfo(worker_index=worker, num_workers=workers)


def _slots(sizes: dict[str, int]) -> list[Slot]:
  return [Slot(_Conn(t, w, n)) for t, n in sizes.items() for w in range(n) for _ in range(2)]


def test_chunks_go_to_replicas_in_proportion_to_their_workers():
  slots = _slots({"a:1": 2, "b:1": 3})
  owners = collections.Counter()
  for chunk in range(50):
    (first, *rest) = owner_of(slots, chunk)
    assert len(rest) == 1 and rest[0].replica == first.replica
    owners[first.replica[0], first.conn.server.worker_index] += 1
  assert owners == {(t, w): 10 for t, n in (("a:1", 2), ("b:1", 3)) for w in range(n)}


def test_replicas_of_one_size_deal_chunks_as_before():
  """Replica c mod R, there worker (c // R) mod W: a trainer and another
  running an older client still send each chunk to the same worker."""
  slots = _slots({"a:1": 3, "b:1": 3})
  for chunk in range(24):
    owner = owner_of(slots, chunk)[0]
    assert owner.replica[0] == ["a:1", "b:1"][chunk % 2]
    assert owner.conn.server.worker_index == chunk // 2 % 3


def test_checkout_routes_by_the_connections_the_slots_hold_now():
  """Slots derive owner_of's answer once per set of connections (checkout
  runs per request): a reconnect that reached another worker routes the
  next chunk anew."""
  slots = _slots({"a:1": 2})  # two slots to worker 0, then two to worker 1
  pool = Slots(slots, RetryPolicy())
  deadline = time.monotonic() + 5  # a checkout that would wait fails instead
  given_up = lambda: time.monotonic() > deadline  # noqa: E731
  pool.release(pool.checkout(given_up, route=0), failed=False)  # worker 0's turn derived
  slots[2].conn = _Conn("a:1", 0, 2)  # reconnected: the kernel handed it to worker 0
  taken = [pool.checkout(given_up, route=0) for _ in range(3)]
  assert set(map(id, taken)) == {id(s) for s in slots[:3]}
  assert pool.checkout(given_up, route=1) is slots[3]
