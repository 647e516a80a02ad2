"""The wire: committed stubs match the .proto; tensors round-trip exactly."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.proto import generate, tree, wire


def test_committed_stubs_match_the_proto():
  assert generate.main(["--check"]) == 0, "run `make proto`"


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.uint8).reshape(3, 4),
    np.array([[1.5, -0.0, np.nan]], dtype=np.float32),
    np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian in, little-endian on the wire
    np.array([b"abc", b"de"], dtype="S3"),
    np.array([True, False]),
    np.zeros((0, 5), dtype=np.int64),
])
def test_tensor_round_trip(array):
  batch = wire.encode_batch(3, [array])
  parsed = type(batch).FromString(batch.SerializeToString())
  (out,) = wire.decode_leaves(parsed)
  assert parsed.step == 3
  assert out.shape == array.shape
  assert out.dtype.newbyteorder("=") == array.dtype.newbyteorder("=")
  np.testing.assert_array_equal(out, array)


def test_structure_round_trip():
  record = {"b": (np.int64(1), [np.zeros(2), {"z": 1.0}]), "a": np.ones(3)}
  leaves, structure, paths = tree.flatten(record)
  assert paths == ["a", "b/0", "b/1/0", "b/1/1/z"]
  rebuilt = tree.unflatten(tree.structure_from_json(tree.structure_to_json(structure)), leaves)
  assert list(rebuilt) == ["a", "b"] and isinstance(rebuilt["b"], tuple)
  assert isinstance(rebuilt["b"][1], list) and rebuilt["b"][1][1] == {"z": 1.0}


def test_non_string_dict_keys_are_refused():
  with pytest.raises(TypeError, match="dict keys must be strings"):
    tree.flatten({1: np.zeros(1)})
