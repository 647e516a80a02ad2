"""Evaluation mode (drop_remainder = false): every record exactly once over
all hosts and steps, the final batch padded with zero rows and masked out,
and every host stops at the same step. The expected records come from
Grain's own pipeline, built here independently of the server."""

from __future__ import annotations

import functools
import glob
import os

import grain
import numpy as np
import pytest

from grain_elevator.client import ConfigError, RemoteDataset
from grain_elevator.pipelines import examples
import datasets
from helpers import assert_streams_equal

G, N = 96, 1000  # 1,000 = 10 * 96 + 40: 11 steps, the last with 40 real rows
IMAGE = {"height": 4, "width": 4, "channels": 3}


@pytest.fixture(scope="module")
def grain_records(data_dir) -> dict[str, np.ndarray]:
  """The "eval" dataset's records, in stream order, by Grain itself."""
  files = sorted(glob.glob(os.path.join(data_dir, "shards", "*.array_record")))
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files)).seed(13).shuffle()
  ds = ds.map(functools.partial(examples.decode_record, **IMAGE))
  rows = [ds[i] for i in range(len(ds))]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.fixture(scope="module")
def server(serve):
  """The conftest's datasets ("eval") on two workers, in-process."""
  return serve(workers=2)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_record_once_then_every_host_stops(server, grain_records, n):
  rows = G // n
  seen: dict[int, list[dict[str, np.ndarray]]] = {}
  for h in range(n):
    with RemoteDataset(server.target, "eval", G, shard_index=h, shard_count=n) as ds:
      seen[h] = list(ds)
  assert {h: len(b) for h, b in seen.items()} == {h: 11 for h in range(n)}
  real = {k: [] for k in grain_records}
  for step in range(11):
    for h in range(n):
      batch = seen[h][step]
      mask = batch["_mask"]
      assert mask.dtype == np.bool_ and mask.shape == (rows,)
      first = step * G + h * rows  # this slice's first position in the stream
      assert mask.tolist() == [first + i < N for i in range(rows)]
      for key, values in batch.items():
        if key != "_mask":
          assert values.shape[0] == rows
          assert not values[~mask].any(), f"padding of {key!r} is not zero"
          real[key].append(values[mask])
  for key, want in grain_records.items():
    np.testing.assert_array_equal(np.concatenate(real[key]), want, err_msg=key)
  assert sorted(np.concatenate(real["id"]).tolist()) == list(range(N))


def test_embedded_mode_is_bit_identical(server, config_path):
  with RemoteDataset(server.target, "eval", G, shard_index=1, shard_count=2) as remote, \
       RemoteDataset.embedded(config_path, "eval", G, shard_index=1, shard_count=2) as local:
    assert assert_streams_equal(remote, local) == 11


def test_resuming_at_the_last_step_gives_the_padded_batch_then_stops(server, grain_records):
  with RemoteDataset(server.target, "eval", G) as ds:
    it = iter(ds)
    it.set_state({**it.get_state(), "step": 10})
    (last,) = list(it)
  assert last["_mask"].sum() == N - 10 * G
  np.testing.assert_array_equal(last["id"][:40], grain_records["id"][10 * G:])


@pytest.mark.parametrize("keys, message", [
    ({"pipeline": datasets.DECODE, "num_epochs": 0, "options": datasets.IMAGE},
     "drop_remainder = false (evaluation mode) needs a finite num_epochs"),
    ({}, "needs records that are dicts without a '_mask' key"),  # raw bytes records
])
def test_evaluation_mode_refuses_what_it_cannot_pad(data_dir, tmp_path, keys, message):
  config = datasets.write_config(tmp_path / "elevator.toml", bad=datasets.dataset(
      data_dir / datasets.SHARDS, drop_remainder=False, **keys))
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    with RemoteDataset.embedded(config, "bad", G) as ds:
      next(iter(ds))
