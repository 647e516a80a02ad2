"""A batch_transform serves exactly the per-record pipeline's rows, faster."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.pipelines import examples
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import registry
from grain_elevator.server.data.config import load_config
import datasets
from helpers import assert_streams_equal

EXAMPLES = "grain_elevator.pipelines.examples"


@pytest.fixture(scope="module")
def server(serve):
  """The conftest's datasets (seed3, seed3fast) on two workers, in-process."""
  return serve(workers=2)


@pytest.mark.parametrize("g,n,h", [(64, 1, 0), (30, 3, 2)])
def test_batch_transform_equals_per_record_pipeline(server, g, n, h):
  kwargs = dict(shard_index=h, shard_count=n)
  with RemoteDataset(server.target, "seed3fast", g, **kwargs) as fast:
    with RemoteDataset(server.target, "seed3", g, **kwargs) as slow:
      assert assert_streams_equal(fast, slow) == 1000 // g


@pytest.mark.parametrize("pipeline,transform,message", [
    ("decode_and_augment", "decode_images_batch",
     "batch_transform 'grain_elevator.pipelines.examples:decode_images_batch' fails "
     "on positions 0..63: CollateError: batch_transform returned structure"),
    ("decode_images", "encode_record", "fails on positions 0..63: TypeError"),
])
def test_batch_transform_that_differs_is_refused(data_dir, pipeline, transform, message):
  path = datasets.write_config(data_dir / "bad_batch.toml", d=datasets.images(
      pipeline=f"{EXAMPLES}:{pipeline}", batch_transform=f"{EXAMPLES}:{transform}"))
  with pytest.raises(ConfigError, match="dataset 'd'") as info:
    registry.Datasets(load_config(path))
  assert message in str(info.value)


def test_batch_transform_with_other_values_is_refused(data_dir, tmp_path, monkeypatch):
  (tmp_path / "off_by_one.py").write_text(
      "from grain_elevator.pipelines.examples import decode_images_batch\n"
      "def decode(raw, **kw):\n"
      "  out = decode_images_batch(raw, **kw)\n"
      "  out['label'] = out['label'] + 1\n"
      "  return out\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  path = datasets.write_config(data_dir / "off_by_one.toml",
                               d=datasets.images(batch_transform="off_by_one:decode"))
  with pytest.raises(ConfigError, match=r"does not reproduce pipeline .*: leaf 'label' differs"):
    registry.Datasets(load_config(path))


@pytest.mark.parametrize("shape", [(4, 4, 3), (96, 96, 3)])  # joined; copied each
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_images_batch_is_the_stacked_per_record_decode(shape, normalize):
  h, w, c = shape
  rng = np.random.default_rng(0)
  raw = [examples.encode_record(i, 7 * i, rng.integers(0, 256, shape, dtype=np.uint8))
         for i in range(5)]
  fast = examples.decode_images_batch(raw, height=h, width=w, channels=c,
                                      normalize=normalize)
  rows = [examples.decode_record(r, h, w, c) for r in raw]
  if normalize:
    rows = [examples._normalize(r) for r in rows]  # pylint: disable=protected-access
  for key in ("id", "label", "image"):
    want = np.stack([r[key] for r in rows])
    assert fast[key].dtype == want.dtype and fast[key].tobytes() == want.tobytes(), key
