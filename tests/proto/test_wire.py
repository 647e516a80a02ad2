"""The wire: committed stubs match the .proto; tensors round-trip exactly."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import numpy as np
import pytest

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import generate, tree, wire
from helpers import ROOT, proto_batch, proto_leaves


def test_committed_stubs_match_the_proto():
  assert generate.main(["--check"]) == 0, "run `make proto`"


def test_the_stubs_need_no_more_than_the_package_requires():
  """The stubs refuse a grpcio older than the generator that made them, and
  a protobuf older than its protoc: those versions are pyproject.toml's
  floors, and the test extra pins that generator, so the check above
  compares with the generator that made them (a newer one stamps its own
  version and fails it)."""
  grpc_stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                         (generate.PROTO_DIR / "elevator_pb2_grpc.py").read_text())[1]
  protobuf_stamp = re.search(r"# Protobuf Python Version: ([0-9.]+)",
                             (generate.PROTO_DIR / "elevator_pb2.py").read_text())[1]
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert f"grpcio>={grpc_stamp}" in project["dependencies"]
  assert f"protobuf>={protobuf_stamp}" in project["dependencies"]
  assert f"grpcio-tools=={grpc_stamp}" in project["optional-dependencies"]["test"]
  assert importlib.metadata.version("grpcio-tools") == grpc_stamp


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.uint8).reshape(3, 4),
    np.array([[1.5, -0.0, np.nan]], dtype=np.float32),
    np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian in, little-endian on the wire
    np.array([b"abc", b"de"], dtype="S3"),
    np.array([True, False]),
    np.zeros((0, 5), dtype=np.int64),
])
def test_tensor_round_trip(array):
  data = wire.encode_batch_bytes(3, [array])
  parsed = pb.Batch.FromString(data)  # valid for protobuf's own parser
  step, (out,) = wire.decode_batch_bytes(data)
  assert parsed.step == step == 3
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


LEAF_CASES = [
    [np.arange(12, dtype=np.uint8).reshape(3, 4), np.arange(3, dtype=np.int64)],
    [np.array([[1.5, -0.0, np.nan]], dtype=np.float32)],
    [np.arange(6, dtype=">i4").reshape(2, 3)],
    [np.array([b"abc", b"de"], dtype="S3"), np.zeros((0, 5), dtype=np.int64)],
    [np.random.default_rng(0).random((300, 70)).astype(np.float16)],  # multi-byte varints
]


@pytest.mark.parametrize("leaves", LEAF_CASES)
@pytest.mark.parametrize("step", [0, 1, 300, 10**12])
def test_fast_encoding_is_the_proto_encoding(step, leaves):
  fast = wire.encode_batch_bytes(step, leaves)
  assert fast == proto_batch(step, leaves).SerializeToString()


@pytest.mark.parametrize("leaves", LEAF_CASES)
def test_fast_decoding_reads_what_protobuf_writes(leaves):
  msg = proto_batch(7, leaves)
  step, out = wire.decode_batch_bytes(msg.SerializeToString())
  assert step == 7
  for got, want in zip(out, proto_leaves(msg), strict=True):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
  # Unknown fields (a newer server) are skipped, and unpacked shapes read.
  extra = msg.SerializeToString() + b"\x98\x06\x05" + b"\xa2\x06\x02hi"
  assert wire.decode_batch_bytes(extra)[0] == 7
  t = pb.Tensor(dtype="int32", data=np.arange(6, dtype="<i4").tobytes())
  unpacked = b"\x0a\x05int32" + b"".join(b"\x10" + bytes([d]) for d in (2, 3)) + \
      b"\x1a\x18" + t.data
  (arr,) = wire.decode_batch_bytes(b"\x12" + bytes([len(unpacked)]) + unpacked)[1]
  np.testing.assert_array_equal(arr, np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("garbage", [b"\x12\x05ab", b"\x08", b"\x12\x02\x1a\x09"])
def test_fast_decoding_refuses_truncated_messages(garbage):
  with pytest.raises(ValueError):
    wire.decode_batch_bytes(garbage)


@pytest.mark.parametrize("leaves", LEAF_CASES)
def test_zstd_batches_are_valid_protobuf_and_round_trip(leaves):
  """Compressed tensors stay readable by any language's stubs (zstd frame in
  Tensor.data, Tensor.compression set); small ones go raw."""
  import zstandard
  data = wire.encode_batch_bytes(3, leaves, wire.COMPRESSION_ZSTD)
  msg = pb.Batch.FromString(data)  # protobuf's own parser accepts it
  for t, a in zip(msg.leaves, leaves, strict=True):
    big = a.nbytes >= wire.MIN_COMPRESSED_BYTES
    assert t.compression == (pb.COMPRESSION_ZSTD if big else pb.COMPRESSION_NONE)
    raw = zstandard.ZstdDecompressor().decompress(t.data) if big else t.data
    assert raw == np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"))).tobytes()
  step, out = wire.decode_batch_bytes(data)
  assert step == 3
  for got, want in zip(out, proto_leaves(msg), strict=True):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes() == np.asarray(
        want, dtype=got.dtype).tobytes()


def test_unknown_compression_is_refused():
  with pytest.raises(ValueError, match="unknown compression"):
    wire.encode_batch_bytes(0, [np.zeros(5000, np.uint8)], 7)
  bad = b"\x12\x0c\x0a\x05uint8\x1a\x01\x00\x20\x07"
  with pytest.raises(ValueError, match="unknown compression 7"):
    wire.decode_batch_bytes(bad)


@pytest.mark.parametrize("text", [", int6O4", "i4,i4", "(2,)i4", "[('a', 'i4')]", "O",
                                  "x" * 100])
def test_a_dtype_text_that_is_no_dtype_name_is_refused_before_numpy(text):
  # np.dtype parses comma-separated text with ast.literal_eval: a mutated
  # name (the wire fuzzer's first finding) escaped the decoder as SyntaxError.
  batch = pb.Batch(step=0, leaves=[pb.Tensor(dtype=text, shape=[1], data=b"\0" * 8)])
  with pytest.raises(wire.BadBatchError, match="dtype"):
    wire.decode_batch_bytes(batch.SerializeToString())
