"""TFDS datasets by name: the service and embedded mode serve exactly
`tfds.data_source(name, split=, data_dir=)` under Grain's own seed, shuffle,
repeat and pipeline; bad names, splits and folders refuse the start.

The dataset is a real TFDS dataset in ArrayRecord format, prepared by TFDS's
own builder without TensorFlow (tools/tfds_example.py).
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import grain
import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from grain_elevator.client import RemoteDataset
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import registry
from grain_elevator.server.data.config import load_config
from grain_elevator.tools import tfds_example
from grain_elevator.tools.testing.launcher import ELEVATOR
import datasets
from helpers import assert_streams_equal, assert_trees_equal

NAME = "elevator_tfds_test"
TRAIN, TEST = 300, 40



def tfds_dataset(tfds: str = NAME, *, data_dir: str = "tfds", **keys) -> dict:
  """A TFDS dataset's table (prepared under `data_dir`, relative to the config)."""
  return datasets.dataset(None, tfds=tfds, data_dir=data_dir, **keys)


DATASETS = {
    # shuffled, 2 epochs, a random transform
    "aug": tfds_dataset(split="train", seed=7, num_epochs=2,
                        pipeline="grain_elevator.tools.tfds_example:augment"),
    # TFDS split syntax across shards and splits
    "sliced": tfds_dataset(f"{NAME}:1.0.0", split="train[25:275]+test", seed=3),
    # no shuffle, no pipeline
    "ordered": tfds_dataset(split="test", shuffle=False),
}


@pytest.fixture(scope="module")
def tfds_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("tfds")
  rng = np.random.default_rng(0)
  splits = {split: (rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8),
                    rng.integers(0, 10, n))
            for split, n in (("train", TRAIN), ("test", TEST))}
  tfds_example.write_tfds_dataset(str(root / "tfds"), NAME, splits, num_classes=10,
                                  shards_per_split=3)
  datasets.write_config(root / "elevator.toml", **DATASETS)
  return root


@pytest.fixture(scope="module")
def tfds_config(tfds_root: pathlib.Path) -> str:
  return str(tfds_root / "elevator.toml")


def _tfds_oracle(root: pathlib.Path, dataset: str) -> grain.MapDataset:
  """The contract written out on TFDS's own data source, one record a call."""
  c = load_config(root / "elevator.toml").datasets[dataset]
  source = tfds.data_source(c.tfds.name, split=c.tfds.split, data_dir=c.tfds.data_dir,
                            download=False)
  ds = grain.MapDataset.source(source).seed(c.seed)
  if c.shuffle:
    ds = ds.shuffle()
  ds = ds.repeat(c.num_epochs or None)
  fn = c.pipeline_fn()
  return fn(ds, **c.options) if fn else ds


def _oracle_batches(records: grain.MapDataset, g: int, h: int, n: int):
  rows = g // n
  for k in range(len(records) // g):
    start = k * g + h * rows
    batch = [records[i] for i in range(start, start + rows)]
    yield {key: np.stack([np.asarray(r[key]) for r in batch]) for key in batch[0]}


@pytest.mark.parametrize("dataset,g,n,h", [
    ("aug", 32, 1, 0), ("aug", 32, 2, 1), ("sliced", 20, 2, 0), ("ordered", 8, 1, 0)])
def test_embedded_equals_tfds_data_source(tfds_root, tfds_config, dataset, g, n, h):
  expected = list(_oracle_batches(_tfds_oracle(tfds_root, dataset), g, h, n))
  with RemoteDataset.embedded(tfds_config, dataset, g, shard_index=h, shard_count=n,
                              prefetch=0) as local:
    assert assert_streams_equal(local, expected) == len(expected)
    assert expected  # the oracle itself is not empty


@pytest.fixture(scope="module")
def tfds_server(serve, tfds_config: str):
  return serve(tfds_config, workers=2)


# aug: 2 epochs of TRAIN records; sliced: 250 + TEST; whole global batches only.
@pytest.mark.parametrize("dataset,g,n,h,steps", [
    ("aug", 32, 1, 0, 2 * TRAIN // 32), ("aug", 32, 2, 0, 2 * TRAIN // 32),
    ("aug", 32, 2, 1, 2 * TRAIN // 32), ("sliced", 20, 2, 1, (250 + TEST) // 20)])
def test_service_equals_embedded(tfds_server, tfds_config, dataset, g, n, h, steps):
  with RemoteDataset(tfds_server.target, dataset, g, shard_index=h, shard_count=n) as remote:
    with RemoteDataset.embedded(tfds_config, dataset, g, shard_index=h, shard_count=n,
                                prefetch=0) as local:
      assert assert_streams_equal(remote, local) == steps


def test_resume_mid_stream(tfds_server, tfds_root):
  records = _tfds_oracle(tfds_root, "aug")
  with RemoteDataset(tfds_server.target, "aug", 32) as ds:
    it = iter(ds)
    for _ in range(5):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
  with RemoteDataset(tfds_server.target, "aug", 32) as ds:
    it = iter(ds)
    it.set_state(state)
    assert_trees_equal(next(it), list(_oracle_batches(records, 32, 0, 1))[5], "step 5")


def test_splits_have_their_own_fingerprint(tfds_config):
  opened = registry.Datasets(load_config(tfds_config))
  prints = {name: opened.get(name).info.config_fingerprint for name in opened.names}
  assert len(set(prints.values())) == 3
  assert opened.get("sliced").info.num_records == 250 + TEST


def _write(root: pathlib.Path, d: dict, name: str = "bad.toml") -> str:
  """A config of one dataset, "d"."""
  return datasets.write_config(root / name, d=d)


@pytest.mark.parametrize("d,message", [
    (tfds_dataset("no_such_dataset"), r"TFDS dataset 'no_such_dataset' not found in data_dir"),
    (tfds_dataset(f"{NAME}:9.9.9"), rf"TFDS dataset '{NAME}:9.9.9' not found .*versions on disk: 1.0.0"),
    (tfds_dataset(split="validation"),
     r"key 'split': 'validation' is not a split of TFDS dataset .*Unknown split"),
    (tfds_dataset(split="train[:200%]"), r"key 'split': 'train\[:200%\]' is not a split"),
    (tfds_dataset(data_dir="nowhere"), r"key 'data_dir': '.*nowhere' is not a folder"),
    (datasets.dataset(["x"], tfds=NAME, data_dir="tfds"), r"give one of 'paths', 'tfds', 'source', not 'paths' and 'tfds'"),
    (datasets.dataset("tfds/**/*array_record*", split="train"),
     r"key\(s\) 'split' belong to a 'tfds' dataset"),
    (datasets.dataset(None, tfds=3), r"key 'tfds' must be a TFDS name"),
])
def test_bad_tfds_config_names_the_problem(tfds_root, d, message):
  path = _write(tfds_root, d)
  with pytest.raises(ConfigError, match=r"dataset 'd': " + message):
    load_config(path)


def test_registered_but_unprepared_dataset_says_how_to_build_it(tfds_root, tmp_path):
  path = _write(tmp_path, tfds_dataset("mnist", data_dir="."))
  with pytest.raises(ConfigError, match=r"TFDS dataset 'mnist' is not prepared in data_dir "
                                        r".*tfds build mnist --file_format=array_record"):
    load_config(path)


def test_tfrecord_format_is_refused_with_the_way_out(tfds_root, tmp_path):
  """What `tfds build` without --file_format=array_record leaves behind."""
  import shutil
  copy = tmp_path / "tfds"
  shutil.copytree(tfds_root / "tfds", copy)
  info_path = next(copy.glob(f"{NAME}/1.0.0/dataset_info.json"))
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info.pop("alternativeFileFormats", None)
  info_path.write_text(json.dumps(info))
  path = _write(tmp_path, tfds_dataset())
  with pytest.raises(ConfigError, match=r"stored as tfrecord, not ArrayRecord; rebuild it "
                                        r"with `tfds build --file_format=array_record`"):
    load_config(path)


def test_serve_exits_naming_the_split(tfds_root):
  path = _write(tfds_root, tfds_dataset(split="dev"), "bad_serve.toml")
  result = subprocess.run([*ELEVATOR, "serve", "--config", path, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "elevator: error: dataset 'd': key 'split': 'dev' is not a split" in result.stderr
  assert "Traceback" not in result.stderr


def test_serving_does_not_import_tensorflow(tfds_server):
  """TFDS reads without TensorFlow; a server never pulls it in: its workers
  (which have served the tests above) nor the fork server they come from."""
  import psutil
  workers = [psutil.Process(pid) for pid in tfds_server.worker_pids()]
  assert len(workers) == 2
  for child in {*workers, *(w.parent() for w in workers)}:
    maps = pathlib.Path(f"/proc/{child.pid}/maps").read_text()
    assert "libtensorflow" not in maps and "_pywrap_tensorflow" not in maps


def test_datasets_without_pipeline_decode_whole_batches(tfds_config):
  """The batch decoder serves `sliced` and `ordered` (checked at start
  against TFDS's per-record decode; the oracle tests above compare its
  output); `aug`'s pipeline needs records one by one."""
  opened = registry.Datasets(load_config(tfds_config))
  assert "TFDS batch decoder of id, image, label" in repr(opened.get("sliced")._batch_fn)
  assert opened.get("ordered")._batch_fn is not None
  assert opened.get("aug")._batch_fn is None


@pytest.fixture(scope="module")
def corrupt_server(serve, tfds_root, tmp_path_factory):
  """The dataset with one record of one shard replaced by bytes that are
  validly stored (ArrayRecord's hashes check) but are no Example."""
  import shutil
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  from array_record.python.array_record_module import ArrayRecordWriter
  root = tmp_path_factory.mktemp("tfds-corrupt")
  shutil.copytree(tfds_root / "tfds", root / "tfds")
  shard = sorted((root / "tfds").glob(f"{NAME}/1.0.0/*train.array_record-00001-*"))[0]
  records = list(ArrayRecordDataSource([str(shard)]))
  writer = ArrayRecordWriter(str(shard), "group_size:1")
  for i, record in enumerate(records):
    writer.write(b"\xff\xfe not an Example" if i == 5 else record)
  writer.close()
  # aug and plain in shard order: aug decodes record by record, plain by batch.
  aug = {k: v for k, v in DATASETS["aug"].items() if k != "seed"}
  config = datasets.write_config(root / "elevator.toml", **{
      **DATASETS, "aug": {**aug, "shuffle": False}, "plain": tfds_dataset(shuffle=False)})
  return serve(config), shard, len(records)


@pytest.mark.parametrize("dataset", ["aug", "plain"])  # per-record decode; batch decoder
def test_record_tfds_cannot_decode_is_data_loss_naming_shard_and_record(corrupt_server,
                                                                        dataset):
  from grain_elevator.client import DataLossError
  server, shard, _ = corrupt_server
  first_shard = TRAIN - 2 * (TRAIN // 3)  # TFDS puts the remainder in shard 0
  bad_step = (first_shard + 5) // 20
  with RemoteDataset(server.target, dataset, 20, prefetch=0) as ds:
    it = iter(ds)
    it.set_state({**it.get_state(), "step": bad_step})
    with pytest.raises(DataLossError, match=rf"dataset '{dataset}', step {bad_step}: shard "
                                            rf"{shard} record 5 is not an Example"):
      next(it)
  with RemoteDataset(server.target, dataset, 20, prefetch=0) as ds:  # the rest still serves
    it = iter(ds)
    it.set_state({**it.get_state(), "step": bad_step + 1})
    assert next(it)["image"].shape == (20, 6, 5, 3)


def _write_feature_zoo(data_dir: str, name: str, features: dict, make) -> None:
  """A TFDS dataset of any features, prepared by TFDS's builder (no TensorFlow)."""
  with tfds.core.registered.skip_registration():

    class _Zoo(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")
      code_path = None

      def _info(self):
        return tfds.core.DatasetInfo(builder=self,
                                     features=tfds.features.FeaturesDict(features))

      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

      def _generate_examples(self):
        for i in range(150):
          yield i, make(i)

    _Zoo.name = name
    _Zoo(data_dir=data_dir, file_format="array_record").download_and_prepare()


@pytest.mark.parametrize("with_uint64", [False, True])
def test_feature_types_decode_as_tfds_does(tmp_path, with_uint64):
  """Floats, bools, vectors and class labels go through the batch decoder;
  a feature it leaves to TFDS (uint64, stored bit-cast) turns it off. Either
  way the batches are tfds.data_source's records, stacked."""
  features = {"vec": tfds.features.Tensor(shape=(3,), dtype=np.float32),
              "score": np.float32, "flag": np.bool_,
              "label": tfds.features.ClassLabel(num_classes=5),
              "grid": tfds.features.Tensor(shape=(2, 2), dtype=np.int32)}
  if with_uint64:
    features["big"] = np.uint64

  def make(i):
    rng = np.random.default_rng(i)
    row = {"vec": rng.standard_normal(3).astype(np.float32),
           "score": np.float32(rng.standard_normal()), "flag": bool(i % 3),
           "label": i % 5, "grid": rng.integers(-9, 9, (2, 2)).astype(np.int32)}
    if with_uint64:
      row["big"] = np.uint64(2**64 - 1 - i)
    return row

  name = f"elevator_zoo{int(with_uint64)}"
  _write_feature_zoo(str(tmp_path / "tfds"), name, features, make)
  datasets.write_config(tmp_path / "elevator.toml", zoo=tfds_dataset(name, seed=4))
  opened = registry.Datasets(load_config(tmp_path / "elevator.toml"))
  assert (opened.get("zoo")._batch_fn is None) == with_uint64
  source = tfds.data_source(name, split="train", data_dir=str(tmp_path / "tfds"),
                            download=False)
  records = grain.MapDataset.source(source).seed(4).shuffle()
  expected = list(_oracle_batches(records, 30, 0, 1))
  with RemoteDataset.embedded(str(tmp_path / "elevator.toml"), "zoo", 30, prefetch=0) as local:
    assert assert_streams_equal(local, expected) == 5
