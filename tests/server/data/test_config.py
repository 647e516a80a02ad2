"""A bad config fails at start-up with a message naming dataset, key and problem."""

from __future__ import annotations

import subprocess
from typing import Any

import numpy as np
import pytest

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import registry
from grain_elevator.server.data.config import load_config
from grain_elevator.tools.testing.launcher import ELEVATOR
import datasets

GOOD = datasets.images()  # the conftest's shards, decoded


def _without_paths(**keys: Any) -> dict[str, Any]:
  """GOOD with its paths under another key."""
  return {k: v for k, v in GOOD.items() if k != "paths"} | keys


def _write(data_dir, config: dict[str, Any] | str, name: str = "bad.toml") -> str:
  """A config of one dataset, "d", or a file's text as it is (for what
  the datasets' tables cannot say: another top level, not TOML at all)."""
  if isinstance(config, dict):
    return datasets.write_config(data_dir / name, d=config)
  path = data_dir / name
  path.write_text(config)
  return str(path)


@pytest.mark.parametrize("config,message", [
    (_without_paths(pathz=GOOD["paths"]), "dataset 'd': unknown key(s) 'pathz'"),
    ({**GOOD, "colour": 3}, "dataset 'd': unknown key(s) 'colour'"),
    (datasets.images("missing/*.array_record"),
     "dataset 'd': key 'paths': 'missing/*.array_record' matches no files"),
    (datasets.images(pipeline="grain_elevator.pipelines.nosuchmodule:f"),
     "dataset 'd': key 'pipeline': cannot import module 'grain_elevator.pipelines.nosuchmodule'"),
    (datasets.images(pipeline="grain_elevator.pipelines.examples:nope"),
     "dataset 'd': key 'pipeline': module 'grain_elevator.pipelines.examples' has no attribute 'nope'"),
    (datasets.images(pipeline="no_colon"),
     "key 'pipeline' must look like 'package.module:function'"),
    ({**GOOD, "seed": -1}, "dataset 'd': key 'seed' must be in [0, 2**32)"),
    ({**GOOD, "seed": "x"}, "dataset 'd': key 'seed' must be an integer"),
    ({**GOOD, "shuffle": 1}, "dataset 'd': key 'shuffle' must be true or false"),
    ({**GOOD, "num_epochs": -2}, "dataset 'd': key 'num_epochs' must be >= 0"),
    ({**GOOD, "num_epochs": True}, "dataset 'd': key 'num_epochs' must be an integer"),
    ("[datasets]\n", "defines no [datasets.NAME] table"),
    ("[dataset.x]\npaths=[]\n", "unknown top-level key(s) 'dataset'"),
    ("this is not toml", "is not valid TOML"),
])
def test_bad_config_names_the_problem(data_dir, config, message):
  with pytest.raises(ConfigError) as info:
    load_config(_write(data_dir, config))
  assert message in str(info.value)


@pytest.mark.parametrize("pipeline,message", [
    ("grain_elevator.pipelines.examples:encode_record",  # wrong signature
     "pipeline 'grain_elevator.pipelines.examples:encode_record' failed: TypeError"),
    ("builtins:list", "returned list, expected a grain.MapDataset"),
])
def test_pipeline_that_cannot_serve_is_refused(data_dir, pipeline, message):
  with pytest.raises(ConfigError, match="dataset 'd'") as info:
    registry.Datasets(load_config(_write(data_dir, datasets.dataset(pipeline=pipeline))))
  assert message in str(info.value)


def test_unknown_pipeline_option_is_named(data_dir):
  config = datasets.images(options={"colour": 1})
  with pytest.raises(ConfigError, match=r"dataset 'd': pipeline .* failed: TypeError: .*colour"):
    registry.Datasets(load_config(_write(data_dir, config)))


def test_a_pipeline_that_changes_the_record_count_is_a_stream(data_dir, tmp_path,
                                                              monkeypatch):
  """Not 1:1, so no step arithmetic: served as a stream dataset (its batches
  Grain's own, server/data/streams/stream.py), not refused."""
  (tmp_path / "halving_pipeline.py").write_text(
      "def drop_half(ds):\n  return ds[::2]\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  config = datasets.dataset(pipeline="halving_pipeline:drop_half")
  ds = registry.Datasets(load_config(_write(data_dir, config))).get("d")
  assert ds.info.stream and ds.info.num_records == 1000
  batches = [leaves for leaves, _ in ds.batches(100, "")]
  assert len(batches) == 5  # 500 records left: 5 whole batches of 100
  want = np.array([ds.records[i] for i in range(0, 1000, 2)])  # fixed-size bytes
  assert np.concatenate([b[0] for b in batches]).tobytes() == want.tobytes()


def test_serve_exits_with_the_message(data_dir):
  path = _write(data_dir, _without_paths(pathz=GOOD["paths"]), "bad_serve.toml")
  result = subprocess.run([*ELEVATOR, "serve", "--config", path, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "elevator: error: dataset 'd': unknown key(s) 'pathz'" in result.stderr


def test_serve_refuses_a_missing_config(tmp_path):
  result = subprocess.run(
      [*ELEVATOR, "serve", "--config", str(tmp_path / "none.toml"), "--port", "0"],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "none.toml' does not exist" in result.stderr


def test_truncated_shard_is_refused_at_start_up(data_dir, tmp_path):
  (shard,) = [p for p in (data_dir / "shards").iterdir() if p.name.startswith("train-00000")]
  (tmp_path / "shards").mkdir()
  (tmp_path / "shards" / shard.name).write_bytes(shard.read_bytes()[:-100])
  path = _write(tmp_path, GOOD, "truncated.toml")
  with pytest.raises(ConfigError, match="dataset 'd': cannot open its shards"):
    registry.Datasets(load_config(path))
