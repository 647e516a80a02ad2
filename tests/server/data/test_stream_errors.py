"""A stream dataset's bad pipelines get clear errors naming the dataset: at
start-up for what the config gets wrong, per request for a record that
fails, and the server goes on serving everything else."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest

from grain_elevator.client import DataLossError, RemoteDataset
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server import Server, ServerOptions
from grain_elevator.server.data import registry
import datasets
from helpers import assert_streams_equal

_PIPES = '''
import grain
import numpy as np
from grain_elevator.pipelines import examples


def failing_on_id_300(ds, **image):
  def check(r):
    if int(r["id"]) == 300:
      raise ValueError("record 300 is unreadable")
    return r
  return examples.decode_images(ds, **image).filter(lambda r: True).map(check)


def not_an_iter_dataset(ds):
  return [1, 2, 3]


def rows_disagree(values):
  return {"a": np.zeros(len(values)), "b": np.zeros(len(values) + 1)}


def drop_all_but_one(ds, **image):
  return examples.decode_images(ds, **image).filter(lambda r: int(r["id"]) == 5)


def wider_past_one(values):
  """Rows of one column in a batch of one (what start-up sees), two after."""
  return {"id": np.stack([v["id"] for v in values]),
          "pad": np.zeros((len(values), 1 if len(values) == 1 else 2))}


class _Padded(grain.DatasetIterator):
  def __init__(self, parent):
    super().__init__()
    self._it = parent

  def __next__(self):
    return next(self._it)

  def get_state(self):
    return {"parent": self._it.get_state(), "junk": "x" * 20000}

  def set_state(self, state):
    self._it.set_state(state["parent"])


class _BigState(grain.IterDataset):
  def __iter__(self):
    return _Padded(self._parent.__iter__())


def big_state(ds):
  """A state that carries 20 kB of its own: over what a request can carry."""
  return _BigState(ds)
'''

PIPES = "bad_stream_pipes"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory, data_dir: pathlib.Path) -> pathlib.Path:
  """A folder with the pipelines above (importable here, and so in the
  workers of an in-process server: they take this process's sys.path) and
  the conftest's shards (shards/, which the configs name)."""
  root = tmp_path_factory.mktemp("bad_streams")
  (root / f"{PIPES}.py").write_text(_PIPES)
  (root / "shards").symlink_to(data_dir / "shards")
  sys.path.insert(0, str(root))
  return root


def _config(pipes: pathlib.Path, tables: dict[str, Any], name: str) -> str:
  return datasets.write_config(pipes / f"{name}.toml", **tables)


@pytest.mark.parametrize("tables,message", [
    ({"d": datasets.images(iter_pipeline=f"{PIPES}:not_an_iter_dataset")},
     "iter_pipeline 'bad_stream_pipes:not_an_iter_dataset' returned list, expected a "
     "grain.IterDataset"),
    ({"d": datasets.images(batch_fn=f"{PIPES}:rows_disagree")},
     "leaf 'b' of a batch of one is float64[2]; every leaf must be a numeric array with one "
     "row per element"),
    ({"d": datasets.images(pipeline=datasets.DECODE_SOME, num_epochs=1,
                           options={"labels": [99]})},
     "dataset 'd': the stream is empty"),
    ({"d": datasets.raw(iter_options={"length": 8})},
     "key 'iter_options' given without an 'iter_pipeline'"),
    ({"d": datasets.dataset(None, source="nope")},
     "key 'source' must name a registered mixture of fixed weights"),
    ({"f": datasets.images(pipeline=datasets.DECODE_SOME, options={"labels": [1]}),
      "m": datasets.mixture(f=1.0)},
     "pipeline 'grain_elevator.pipelines.examples:decode_some' filters or flat-maps: that "
     "makes it a stream dataset, which cannot be a mixture's component"),
    ({"f": datasets.raw(batch_fn=f"{PIPES}:rows_disagree"), "m": datasets.mixture(f=1.0)},
     "component 'f' is a stream dataset"),
    ({"d": datasets.images(pipeline=datasets.DECODE_SOME,
                           batch_transform="grain_elevator.pipelines.examples:decode_images_batch",
                           options={"labels": [1]})},
     "its pipeline filters or flat-maps, so it is a stream dataset, and 'batch_transform'"),
])
def test_a_bad_stream_config_is_refused_at_start(pipes, tables, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
    path = _config(pipes, tables, "bad")
    registry.Datasets(config_lib.load_config(path))


def test_a_failing_record_or_broken_stream_is_named_and_others_are_served(data_dir, pipes):
  path = _config(pipes, {
      "broken": datasets.images(pipeline=f"{PIPES}:failing_on_id_300", shuffle=False),
      "lonely": datasets.images(pipeline=f"{PIPES}:drop_all_but_one", num_epochs=3),
      "wide": datasets.images(batch_fn=f"{PIPES}:wider_past_one"),
      "big": datasets.raw(iter_pipeline=f"{PIPES}:big_state"),
      "fine": datasets.images(pipeline=datasets.DECODE_SOME, options={"labels": [2]}),
  }, "broken")
  # A private in-process server: its workers import bad_stream_pipes from
  # this process's sys.path, as embedded mode does.
  with Server(path, ServerOptions(port=0, workers=2)) as server:
    workers = sorted(server.worker_pids())
    with RemoteDataset(server.target, "broken", 20) as ds:
      it = iter(ds)
      for _ in range(15):  # records 0..299, in order (no shuffle): 15 steps of 20
        next(it)
      with pytest.raises(DataLossError, match=r"dataset 'broken', step 15 \(stream position "
                                              r"\{.*\}\): ValueError: record 300 is unreadable"):
        next(it)
    # A stream that breaks what it must keep: named, per request.
    with RemoteDataset(server.target, "wide", 4) as ds:
      with pytest.raises(ConfigError, match=r"dataset 'wide', step 0\b.*leaf 'pad' is "
                                            r"float64\[4, 2\], the stream's rows are "
                                            r"float64\[1\].*fixed row shapes"):
        next(iter(ds))
    with RemoteDataset(server.target, "big", 4) as ds:
      with pytest.raises(ConfigError, match=r"dataset 'big', step 0\b.*position is \d+ bytes "
                                            r"of JSON, over the 16384"):
        next(iter(ds))
    # A filter that keeps one record in a thousand: slow to fill, still exact.
    with RemoteDataset(server.target, "lonely", 3) as ds:
      got = list(ds)
    assert [b["id"].tolist() for b in got] == [[5, 5, 5]]
    with RemoteDataset(server.target, "fine", 8) as remote, \
        RemoteDataset.embedded(path, "fine", 8) as local:
      assert assert_streams_equal(remote, local) == _count_label(data_dir, 2) // 8
    assert sorted(server.worker_pids()) == workers  # no request ended a worker


def _count_label(data_dir: pathlib.Path, label: int) -> int:
  from array_record.python.array_record_data_source import ArrayRecordDataSource  # pylint: disable=g-import-not-at-top
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  source = ArrayRecordDataSource(sorted(str(p) for p in (data_dir / "shards").glob("*")))
  return sum(int(examples.decode_record(source[i], 4, 4, 3)["label"]) == label
             for i in range(len(source)))
