"""Elastic determinism: host slices for any H concatenate to the same global batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset
from helpers import assert_trees_equal, oracle_batch

STEPS = 12


@pytest.mark.parametrize("dataset,g", [("aug2", 96), ("seed3", 64)])
def test_host_slices_concatenate_to_the_global_batch(server, oracle, dataset, g):
  for n in (1, 2, 4):
    hosts = []
    for h in range(n):
      with RemoteDataset(server.target, dataset, g, shard_index=h,
                         shard_count=n) as ds:
        hosts.append(list(itertools.islice(iter(ds), STEPS)))
    for k in range(STEPS):
      merged = {key: np.concatenate([hosts[h][k][key] for h in range(n)])
                for key in hosts[0][k]}
      assert_trees_equal(merged, oracle_batch(oracle, dataset, k, g), f"H={n} step {k}")
