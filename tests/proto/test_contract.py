"""The contract (docs/design.md), checked against Grain's literal formula."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from grain_elevator.proto import contract
from grain_elevator.proto.errors import EndOfDataError, InvalidRequestError
from grain_elevator.server.data import config as config_lib
import datasets
from helpers import assert_trees_equal, oracle_batch

pytestmark = pytest.mark.grain_contract  # run again on the lowest Grain admitted


@pytest.mark.parametrize("g,h,n,step,expected", [
    (8, 0, 1, 0, range(0, 8)),
    (8, 1, 2, 0, range(4, 8)),
    (8, 3, 4, 5, range(46, 48)),
    (96, 2, 3, 10, range(1024, 1056)),
])
def test_host_positions(g, h, n, step, expected):
  assert contract.host_positions(step, g, h, n) == expected


@pytest.mark.parametrize("g,h,n,message", [
    (0, 0, 1, "global_batch_size must be >= 1"),
    (-5, 0, 1, "global_batch_size must be >= 1"),
    (10, 0, 3, "not divisible by shard_count 3"),
    (8, 2, 2, r"shard_index must be in \[0, 2\)"),
    (8, -1, 2, r"shard_index must be in \[0, 2\)"),
    (8, 0, 0, "shard_count must be in"),
])
def test_bad_geometry(g, h, n, message):
  with pytest.raises(InvalidRequestError, match=message):
    contract.check_geometry(g, h, n)


def test_final_partial_batch_is_dropped():
  assert contract.total_steps(1000, 64) == 15  # 1000 = 15*64 + 40
  contract.check_steps(14, 1, 1000, 64)
  with pytest.raises(EndOfDataError, match="stream has 15 steps"):
    contract.check_steps(15, 1, 1000, 64)
  with pytest.raises(EndOfDataError):
    contract.check_steps(10, 6, 1000, 64)


def _literal_records(config: config_lib.DatasetConfig) -> grain.MapDataset:
  """The contract written out, reading one record per call."""
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(list(config.files)))
  ds = ds.seed(config.seed)
  if config.shuffle:
    ds = ds.shuffle()
  ds = ds.repeat(config.num_epochs or None)
  fn = config.pipeline_fn()
  return fn(ds, **config.options) if fn else ds


@pytest.mark.parametrize("dataset,g,h,n,step", [
    ("aug2", 96, 0, 1, 0),
    ("aug2", 96, 1, 4, 10),     # crosses the epoch boundary at record 1000
    ("aug2", 96, 2, 3, 19),     # last whole step of epoch 2
    ("plain", 50, 1, 2, 3),
    ("seed3", 64, 3, 4, 7),
    ("forever", 128, 0, 2, 40),  # epoch 6 of an endless stream
    ("raw", 16, 0, 1, 2),
])
def test_batched_reads_equal_literal_formula(config_path, oracle, dataset, g, h, n, step):
  """Embedded mode's batched-read path gives exactly the per-record formula."""
  config = config_lib.load_config(config_path).datasets[dataset]
  records = _literal_records(config)
  rows = [records[i] for i in contract.host_positions(step, g, h, n)]
  expected = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]} \
      if isinstance(rows[0], dict) else np.stack([np.asarray(r) for r in rows])
  assert_trees_equal(oracle_batch(oracle, dataset, step, g, h, n), expected)


def test_shuffle_is_a_permutation_per_epoch(oracle):
  """Each epoch of a shuffled 2-epoch stream holds every record once."""
  ids = np.concatenate([oracle_batch(oracle, "aug2", k, 100)["id"] for k in range(20)])
  assert sorted(ids[:1000]) == list(range(1000))
  assert sorted(ids[1000:]) == list(range(1000))
  assert not np.array_equal(ids[:1000], ids[1000:])  # reshuffled per epoch
  assert not np.array_equal(ids[:1000], np.arange(1000))


@pytest.mark.parametrize("reader", ["auto", "arrayrecord"])
def test_big_records_equal_literal_formula(tmp_path, monkeypatch, reader):
  """Records of 64 KiB and up: the shard reader's big-chunk path, and
  ArrayRecord's one-call-per-record path, give the formula's rows."""
  monkeypatch.setenv("ELEVATOR_SHARD_READER", reader)
  from grain_elevator.client.embedded import EmbeddedBackend
  from grain_elevator.pipelines import examples
  from grain_elevator.server.data.record_source import BatchedArrayRecordSource
  examples.write_image_shards(str(tmp_path / "shards"), num_records=60, num_shards=3,
                              height=128, width=192, channels=3)  # 73,744 B records
  path = datasets.write_config(tmp_path / "big.toml", big=datasets.images(
      seed=2, num_epochs=2, image={"height": 128, "width": 192, "channels": 3}))
  config = config_lib.load_config(path).datasets["big"]
  source = BatchedArrayRecordSource(list(config.files))
  assert source._reads_singly()  # pylint: disable=protected-access
  records = _literal_records(config)
  backend = EmbeddedBackend(path)
  for step, (h, n) in ((0, (0, 1)), (3, (1, 2)), (9, (2, 4))):
    rows = [records[i] for i in contract.host_positions(step, 12, h, n)]
    expected = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
    assert_trees_equal(oracle_batch(backend, "big", step, 12, h, n), expected, f"step {step}")
  backend.close()
