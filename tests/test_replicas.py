"""Several replicas behind one client give the same stream as one."""

from __future__ import annotations

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.launcher import LocalServer
from helpers import assert_streams_equal


def test_two_replicas_give_the_same_stream_as_one(server, config_path):
  with LocalServer(config_path, workers=1) as second:
    with RemoteDataset([server.target, second.target], "aug2", 40,
                       shard_index=1, shard_count=2, prefetch=6) as both:
      with RemoteDataset(server.target, "aug2", 40, shard_index=1,
                         shard_count=2) as one:
        assert assert_streams_equal(both, one) == 50
  assert second.proc.returncode == 0, second.stderr()
