"""Grain's private calls (server/data/grain_private.py) mean what their
names say, on whichever Grain release is installed: each is checked against
Grain's public behaviour."""

from __future__ import annotations

import importlib.metadata
import json
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


def test_a_concat_then_split_state_survives_json():
  """ConcatThenSplit's "no remainder" slice is the tuple (-1, -1): through
  JSON it is a list, and restored as it comes it cuts the stream wrong."""
  def make() -> grain.IterDataset:
    docs = [{"tokens": np.arange(n, dtype=np.int32) + 100 * i}
            for i, n in enumerate([5, 9, 3, 20, 7, 11] * 6)]
    return grain.experimental.ConcatThenSplitIterDataset(
        grain.MapDataset.source(docs).to_iter_dataset(), length_struct={"tokens": 8})
  sentinels = 0
  for k in range(1, 24):
    it = iter(make())
    for _ in range(k):
      next(it)
    state = it.get_state()
    sentinels += (-1, -1) in state["remainder_slices"].values()
    want = [next(it)["tokens"] for _ in range(4)]
    restored = iter(make())
    restored.set_state(grain_private.state_from_json(json.loads(json.dumps(state))))
    assert all(np.array_equal(a, next(restored)["tokens"]) for a in want), k
  assert sentinels  # the case that matters was among them
