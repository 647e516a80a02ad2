"""Connections spread evenly over a replica's worker processes."""

from __future__ import annotations

import collections

import pytest

from grain_elevator.client import TransportOptions
from grain_elevator.client.transport.pool import ConnectionPool
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.tools.launcher import LocalServer


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


@pytest.mark.slow  # a second, 3-worker server
@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_every_replica_gets_its_share(server, config_path, transport):
  with LocalServer(config_path, workers=3) as second:
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
