"""Big rows go to the socket unstacked (RowStack): the same bytes on every
transport as the stacked batch, and as embedded mode, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.pipelines import examples
from grain_elevator.pipelines import MIN_ROW_BYTES, RowStack
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree, wire
from grain_elevator.server.data import collate
import datasets
from helpers import assert_streams_equal, proto_batch

BIG = {"height": 96, "width": 96, "channels": 3}  # 27,648 B of pixels a record
assert BIG["height"] * BIG["width"] * BIG["channels"] >= MIN_ROW_BYTES


def _rows(n: int = 5, shape=(64, 64, 4), dtype=np.uint8) -> list[np.ndarray]:
  rng = np.random.default_rng(n)
  return [rng.integers(0, 200, shape).astype(dtype) for _ in range(n)]


def test_a_row_stack_is_the_stacked_array():
  rows = _rows()
  stack = RowStack(rows)
  want = np.stack(rows)
  assert stack.shape == want.shape and stack.dtype == want.dtype and len(stack) == 5
  assert stack.nbytes == want.nbytes
  assert np.array_equal(np.asarray(stack), want)
  assert stack.tobytes() == want.tobytes()
  assert b"".join(stack.buffers()) == want.tobytes()
  assert all(np.shares_memory(a, b) for a, b in zip(stack.rows, rows))  # held, not copied


@pytest.mark.parametrize("rows,message", [
    ([], "at least one row"),
    ([np.zeros(4), [0, 0, 0, 0]], "row 1 is list"),
    ([np.zeros(4), np.zeros(5)], r"row 1 is float64\[5\], row 0 is float64\[4\]"),
    ([np.zeros(4), np.zeros(4, np.float32)], "row 1 is float32"),
    ([np.zeros((4, 4)), np.zeros((4, 8))[:, ::2]], "row 1 is not C-contiguous"),
])
def test_rows_that_cannot_stack_are_refused(rows, message):
  with pytest.raises((ValueError, TypeError), match=message):
    RowStack(rows)


def test_a_row_stack_of_empty_rows_is_the_empty_stack():
  rows = [np.zeros((0, 3), np.float32)] * 4
  stack = RowStack(rows)
  assert stack.nbytes == 0 and [len(b) for b in stack.buffers()] == [0] * 4
  want = proto_batch(5, [np.stack(rows)]).SerializeToString()
  assert wire.encode_batch_bytes(5, [stack]) == want


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, ">i4", "S7"])
@pytest.mark.parametrize("step", [0, 12])
def test_a_row_stack_encodes_as_the_stacked_batch(dtype, step):
  rows = [r.astype(dtype) for r in _rows(3, (9, 11))]
  leaves = [np.arange(3), RowStack(rows)]
  stacked = [np.arange(3), np.stack(rows)]
  want = proto_batch(step, stacked).SerializeToString()
  assert wire.encode_batch_bytes(step, leaves) == want
  got_step, got = wire.decode_batch_bytes(want)
  assert got_step == step and got[1].tobytes() == np.stack(rows).astype(
      np.dtype(dtype).newbyteorder("<")).tobytes()


def test_a_compressed_row_stack_round_trips():
  rows = [np.full((64, 64), i, np.uint8) for i in range(4)]
  data = wire.encode_batch_bytes(3, [RowStack(rows)], wire.COMPRESSION_ZSTD)
  message = pb.Batch.FromString(data)
  assert message.leaves[0].compression == wire.COMPRESSION_ZSTD
  assert len(message.leaves[0].data) < 4 * 64 * 64
  assert np.array_equal(wire.decode_batch_bytes(data)[1][0], np.stack(rows))


def _spec(record):
  leaves, structure, paths = tree.flatten(record)
  return structure, [(p, tree.as_array(l).dtype, tree.as_array(l).shape)
                     for p, l in zip(paths, leaves)]


def test_collate_gathers_big_contiguous_rows_and_stacks_the_rest():
  records = [{"big": r, "small": np.float32(i)} for i, r in enumerate(_rows(4))]
  structure, specs = _spec(records[0])
  big, small = collate.collate(records, structure, specs, stack=False)
  assert isinstance(big, RowStack) and isinstance(small, np.ndarray)
  assert all(r is rec["big"] for r, rec in zip(big.rows, records))
  assert np.array_equal(np.asarray(big), np.stack([r["big"] for r in records]))
  stacked = collate.collate(records, structure, specs)  # the default: arrays only
  assert all(isinstance(a, np.ndarray) for a in stacked)
  assert stacked[0].tobytes() == big.tobytes()


def test_collate_stacks_a_leaf_once_a_row_is_strided():
  rows = _rows(4, (64, 128, 4))
  records = [{"big": r[:, :64]} if i == 2 else {"big": np.ascontiguousarray(r[:, :64])}
             for i, r in enumerate(rows)]
  structure, specs = _spec(records[0])
  (leaf,) = collate.collate(records, structure, specs, stack=False)
  assert isinstance(leaf, np.ndarray)
  assert np.array_equal(leaf, np.stack([r[:, :64] for r in rows]))


def _dataset(*, batch_transform: bool, normalize: bool = False, **keys: object) -> dict:
  """A dataset over the big-record shards, 96x96x3 images."""
  return datasets.images(
      "big/*.array_record", image=BIG, seed=2,
      batch_transform=("grain_elevator.pipelines.examples:decode_images_batch"
                       if batch_transform else None),
      options={"normalize": True} if normalize else None, **keys)


CONFIG = datasets.config_text(
    per_record=_dataset(batch_transform=False),  # collate gathers the pixels
    batch=_dataset(batch_transform=True),  # the batch_transform returns a RowStack
    # normalised row by row into one array; 2 epochs
    batch_float=_dataset(batch_transform=True, num_epochs=2, normalize=True),
)


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> str:
  root = tmp_path_factory.mktemp("big-records")
  examples.write_image_shards(str(root / "big"), num_records=120, num_shards=2, **BIG)
  (root / "elevator.toml").write_text(CONFIG)
  return str(root / "elevator.toml")


@pytest.fixture(scope="module")
def big_server(serve, big_config):
  return serve(big_config)


@pytest.mark.parametrize("transport,compression", [
    ("bulk", "none"), ("grpc", "none"), ("bulk", "zstd")])
@pytest.mark.parametrize("dataset", ["per_record", "batch", "batch_float"])
def test_big_rows_are_served_bit_identical_to_embedded(big_server, big_config, dataset,
                                                       transport, compression):
  kwargs = dict(shard_index=1, shard_count=2)
  with RemoteDataset(big_server.target, dataset, 16, transport=TransportOptions(
      kind=transport, compression=compression), **kwargs) as remote:
    with RemoteDataset.embedded(big_config, dataset, 16, prefetch=0, **kwargs) as local:
      steps = assert_streams_equal(remote, local)
  assert steps == (240 if dataset == "batch_float" else 120) // 16


def test_per_record_and_batch_transform_agree_on_big_rows(big_server):
  with RemoteDataset(big_server.target, "batch", 24) as fast:
    with RemoteDataset(big_server.target, "per_record", 24) as slow:
      assert assert_streams_equal(fast, slow) == 5


def test_embedded_mode_hands_the_trainer_arrays(big_config):
  with RemoteDataset.embedded(big_config, "batch", 16) as local:
    batch = next(iter(local))
  assert all(isinstance(v, np.ndarray) for v in batch.values())
  assert batch["image"].shape == (16, 96, 96, 3)
