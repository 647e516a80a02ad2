"""Several replicas behind one client give the oracle's stream, and share it."""

from __future__ import annotations

import collections
from typing import Iterator

import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import assert_streams_equal


@pytest.fixture(scope="module")
def second(config_path: str) -> Iterator[LocalServer]:
  """The second replica, an `elevator serve` process shared by the module's
  tests: once they have read from it, it must exit 0 when stopped."""
  s = LocalServer(config_path, workers=1)
  yield s
  assert s.stop() == 0, s.stderr()


@pytest.mark.parametrize("kind", ["bulk", pytest.param("grpc", marks=pytest.mark.slow)])
def test_two_replicas_give_the_oracle_stream_and_both_serve(server, second, config_path, kind):
  with RemoteDataset([server.target, second.target], "aug2", 40, shard_index=1,
                     shard_count=2, prefetch=6,
                     transport=TransportOptions(kind=kind)) as both:
    it = iter(both)
    with RemoteDataset.embedded(config_path, "aug2", 40, shard_index=1,
                                shard_count=2) as oracle:
      assert assert_streams_equal(it, oracle) == 50
    served = collections.Counter()
    for slot in it._backend.data_slots():  # pylint: disable=protected-access
      served[slot.conn.target] += slot.served
  assert sum(served.values()) == 50
  assert served[server.target] > 0 and served[second.target] > 0, served
  assert second.proc.poll() is None, second.stderr()  # still serving
