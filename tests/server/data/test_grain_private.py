"""Grain's private calls (server/data/grain_private.py) mean what their
names say, on whichever Grain release is installed: each is checked against
Grain's public behaviour."""

from __future__ import annotations

import importlib.metadata
import os

import grain
import numpy as np
import pytest

from grain_elevator.server.data import grain_private

pytestmark = pytest.mark.grain_contract


def test_the_grain_under_test_is_the_one_expected():
  want = os.environ.get("ELEVATOR_EXPECT_GRAIN")
  if not want:
    pytest.skip("ELEVATOR_EXPECT_GRAIN is not set: the virtualenv's own Grain is tested")
  assert importlib.metadata.version("grain") == want


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.7, 0.2, 0.1), (1.0, 3.0)])
def test_mix_pick_is_what_map_dataset_mix_gives(weights):
  sources = [grain.MapDataset.range(j * 10_000, (j + 1) * 10_000) for j in range(len(weights))]
  mixed = grain.MapDataset.mix(sources, weights)
  proportions = grain_private.mix_proportions(weights)
  for record in range(200):
    component, index = grain_private.mix_pick(record, proportions)
    assert mixed[record] == component * 10_000 + index


def test_getitems_is_indexing_in_one_call():
  ds = grain.MapDataset.range(100).seed(3).shuffle()
  positions = [5, 0, 99, 42]
  assert [int(x) for x in grain_private.getitems(ds, positions)] == [ds[p] for p in positions]


def test_index_shuffle_is_a_permutation_of_the_range():
  out = [grain_private.index_shuffle(i, 999, 7, 4) for i in range(1000)]
  assert sorted(out) == list(range(1000)) and out != list(range(1000))


def test_without_read_metrics_leaves_the_records_alone():
  ds = grain.MapDataset.source(np.arange(10))
  assert list(grain_private.without_read_metrics(ds)) == list(range(10))
