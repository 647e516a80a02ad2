"""Corrupt shards and failing pipelines: a precise status, and the worker
keeps serving every other step and dataset."""

from __future__ import annotations

import shutil
import sys

import grpc
import numpy as np
import pytest

from grain_elevator.client import (ConfigError, DataLossError, ElevatorError, RemoteDataset,
                                   StreamMismatchError, TransportOptions)
from grain_elevator.pipelines import examples
from grain_elevator.server import Server, ServerOptions
import datasets

RECORD = 16 + 4 * 4 * 3


@pytest.fixture(scope="module")
def bad_server(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("bad")
  shutil.copytree(data_dir / "shards", root / "shards")
  corrupt = root / "corrupt"
  examples.write_image_shards(str(corrupt), num_records=200, num_shards=1, height=4,
                              width=4, channels=3, prefix="c")
  (path,) = corrupt.glob("*.array_record")
  data = bytearray(path.read_bytes())
  # Zero a stretch of chunk data in the first 64 KiB block, well past record 0
  # (read at start-up) and clear of the block header at byte 0.
  data[2000:2064] = bytes(64)
  path.write_bytes(bytes(data))
  (root / "broken.py").write_text(
      "import numpy as np\n"
      "from grain_elevator.pipelines.examples import decode_images\n"
      "from grain_elevator.server import ConfigError\n"
      "def fail_on_id_7(ds, error=ValueError, **kw):\n"
      "  def check(r):\n"
      "    if r['id'] == 7:\n"
      "      raise error('record 7 is not an image')\n"
      "    return r\n"
      "  return decode_images(ds, **kw).map(check)\n"
      "def config_error_on_id_7(ds, **kw):\n"
      "  return fail_on_id_7(ds, error=ConfigError, **kw)\n")
  config = datasets.write_config(
      root / "elevator.toml",
      good=datasets.images(shuffle=False),
      corrupt=datasets.images("corrupt/*.array_record", shuffle=False),
      failing=datasets.images(pipeline="broken:fail_on_id_7", shuffle=False),
      config_error=datasets.images(pipeline="broken:config_error_on_id_7", shuffle=False))
  # `broken` for embedded mode here, and for the in-process server's worker,
  # which takes this process's sys.path.
  sys.path.insert(0, str(root))
  try:
    with Server(config, ServerOptions(port=0, workers=1)) as server:
      yield server
  finally:
    sys.path.remove(str(root))


def test_corrupt_shard_gives_data_loss_naming_file_and_record(bad_server):
  with RemoteDataset(bad_server.target, "corrupt", 10, prefetch=0) as ds:
    with pytest.raises(DataLossError, match=r"shard .*c-00000-of-00001.array_record is "
                                            r"corrupt: record \d+ cannot be read"):
      for _ in ds:
        pass
  # The same worker still serves the healthy dataset.
  with RemoteDataset(bad_server.target, "good", 10) as ds:
    np.testing.assert_array_equal(next(iter(ds))["id"], np.arange(10))


def test_failing_pipeline_gives_data_loss_naming_dataset_step_and_error(bad_server):
  with RemoteDataset(bad_server.target, "failing", 4, prefetch=0) as ds:
    it = iter(ds)
    np.testing.assert_array_equal(next(it)["id"], np.arange(4))  # step 0 is fine
    with pytest.raises(DataLossError) as info:
      next(it)  # step 1 holds record 7
  assert info.value.code == grpc.StatusCode.DATA_LOSS
  assert "dataset 'failing', step 1: ValueError: record 7 is not an image" in str(info.value)
  with RemoteDataset(bad_server.target, "failing", 4) as ds:
    it = iter(ds)
    it.set_state({**it.get_state(), "step": 2})
    np.testing.assert_array_equal(next(it)["id"], np.arange(8, 12))


def test_steps_received_before_a_failure_in_the_same_request_are_delivered(bad_server):
  """Steps reach the trainer as they arrive: a request for steps 0-3 that
  fails at step 1 still delivers step 0, then the error."""
  with RemoteDataset(bad_server.target, "failing", 4, prefetch=4,
                     transport=TransportOptions(steps_per_request=4)) as ds:
    it = iter(ds)
    np.testing.assert_array_equal(next(it)["id"], np.arange(4))
    with pytest.raises(ElevatorError, match="step 1: ValueError: record 7"):
      next(it)


@pytest.mark.parametrize("kind", ["bulk", "grpc", "embedded"])
def test_an_error_arrives_as_the_class_the_server_raised(bad_server, kind):
  """ConfigError and StreamMismatchError share FAILED_PRECONDITION; the type
  travels with the status, so the trainer sees the server's own class."""
  if kind == "embedded":
    ds = RemoteDataset(f"local:{bad_server.config_path}", "config_error", 4, prefetch=0)
  else:
    ds = RemoteDataset(bad_server.target, "config_error", 4, prefetch=0,
                       transport=TransportOptions(kind=kind))
  with ds:
    it = iter(ds)
    next(it)
    with pytest.raises(ConfigError) as info:
      next(it)
  assert not isinstance(info.value, StreamMismatchError)
  assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
  assert "dataset 'config_error', step 1: record 7 is not an image" in str(info.value)
