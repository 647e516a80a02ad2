"""The service over gRPC is bit-identical to embedded mode (the oracle)."""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.server import Server, ServerOptions
from grain_elevator.server.data.shards.reader import READER_ENV
from helpers import assert_streams_equal, assert_trees_equal, oracle_batch

# (dataset, G, H, h): seeds 7/3/11/5, shuffle on/off, 1 and 2 epochs, forever.
CASES = [
    ("aug2", 96, 1, 0),    # 2 epochs; step 10 crosses the epoch boundary
    ("aug2", 96, 4, 3),
    ("aug2", 40, 2, 1),    # 1000 % 40 == 0: epochs align with steps
    ("plain", 64, 1, 0),   # no shuffle
    ("plain", 64, 8, 5),
    ("seed3", 30, 3, 2),
    ("raw", 32, 2, 0),     # no pipeline: raw bytes
]


@pytest.fixture(scope="module")
def server(serve):
  """The conftest's datasets on two workers, in-process."""
  return serve(workers=2)


@pytest.fixture(scope="module")
def array_record_server(config_path: str) -> Iterator[Server]:
  """A server whose workers read shards through ArrayRecord: they take
  READER_ENV from this process's environment as they start, which has it
  only then (embedded mode here reads with server/data/shards/reader.py)."""
  with pytest.MonkeyPatch.context() as env:
    env.setenv(READER_ENV, "arrayrecord")
    srv = Server(config_path, ServerOptions(port=0, workers=1)).start()
  try:
    yield srv
  finally:
    srv.stop()


@pytest.mark.parametrize("dataset,g,n,h", CASES)
def test_whole_stream_matches_oracle(server, config_path, dataset, g, n, h):
  with RemoteDataset(server.target, dataset, g, shard_index=h, shard_count=n) as remote:
    with RemoteDataset.embedded(config_path, dataset, g, shard_index=h,
                                shard_count=n, prefetch=0) as local:
      steps = assert_streams_equal(remote, local)
  assert steps == (1000 * (2 if dataset == "aug2" else 1)) // g


@pytest.mark.parametrize("g,n,h", [(128, 1, 0), (128, 4, 1)])
def test_endless_dataset_matches_oracle(server, oracle, g, n, h):
  ds = RemoteDataset(server.target, "forever", g, shard_index=h, shard_count=n)
  with ds:
    it = iter(ds)
    for k, batch in enumerate(itertools.islice(it, 25)):  # > 3 epochs
      assert_trees_equal(batch, oracle_batch(oracle, "forever", k, g, h, n), f"step {k}")


def test_random_transform_is_reproducible(server, oracle):
  """random_map draws per-index seeds: the same on every worker and replica."""
  with RemoteDataset(server.target, "aug2", 100) as ds:
    first = next(iter(ds))
  assert_trees_equal(first, oracle_batch(oracle, "aug2", 0, 100))
  assert len(np.unique(first["noise"])) == 100


@pytest.mark.parametrize("prefetch,steps_per_request,connections", [
    (0, 1, 1), (1, 1, 1), (8, 3, 2), (16, 4, 4)])
def test_in_flight_settings_do_not_change_the_stream(server, config_path, prefetch,
                                                     steps_per_request, connections):
  kwargs = dict(shard_index=1, shard_count=2)
  with RemoteDataset(server.target, "aug2", 48, prefetch=prefetch,
                     transport=TransportOptions(steps_per_request=steps_per_request,
                                                connections_per_target=connections),
                     **kwargs) as remote:
    with RemoteDataset.embedded(config_path, "aug2", 48, **kwargs) as local:
      assert assert_streams_equal(remote, local) == 41


@pytest.mark.parametrize("dataset,g,n,h", [
    ("aug2", 96, 2, 1), pytest.param("raw", 32, 1, 0, marks=pytest.mark.slow)])
def test_server_reading_through_array_record_matches_oracle(array_record_server, config_path,
                                                           dataset, g, n, h):
  """The same stream whichever reader a server uses: ArrayRecord's here,
  server/data/shards/reader.py in embedded mode (and in the `server` fixture)."""
  with RemoteDataset(array_record_server.target, dataset, g, shard_index=h,
                     shard_count=n) as remote:
    with RemoteDataset.embedded(config_path, dataset, g, shard_index=h,
                                shard_count=n, prefetch=0) as local:
      assert assert_streams_equal(remote, local) == (1000 * (2 if dataset == "aug2" else 1)) // g
