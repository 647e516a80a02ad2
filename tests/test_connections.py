"""Connections spread evenly over a replica's worker processes."""

from __future__ import annotations

import collections

import pytest

from grain_elevator.client.connections import ConnectionPool
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.server.launcher import LocalServer


def _workers_per_connection(pool: ConnectionPool) -> collections.Counter:
  return collections.Counter(
      stub.Describe(pb.DescribeRequest(dataset="plain"), timeout=10).server.worker_index
      for stub in pool._stubs)  # pylint: disable=protected-access


@pytest.mark.parametrize("per_target", [1, 2, 4])
def test_connections_cover_every_worker_evenly(server, per_target):
  pool = ConnectionPool([server.target], connections_per_target=per_target)
  try:
    pool.describe("plain")
    counts = _workers_per_connection(pool)
    share = -(-per_target // 2)
    assert counts == {0: share, 1: share}, counts
  finally:
    pool.close()


def test_every_replica_gets_its_share(server, config_path):
  with LocalServer(config_path, workers=3) as second:
    pool = ConnectionPool([server.target, second.target], connections_per_target=3)
    try:
      pool.describe("plain")
      # 2 workers x 2 (ceil(3/2)) + 3 workers x 1
      assert pool.num_connections == 7
    finally:
      pool.close()
