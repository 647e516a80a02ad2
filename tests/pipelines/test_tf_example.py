"""The hand-written tf.train.Example codec against protobuf's own (TFDS's
generated tf_example_pb2), its features-spec pipeline, and fuzzing."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grain_elevator.pipelines import tf_example as example
from grain_elevator.pipelines.tf_example import (ExampleError, ExampleParser, encode_example,
                                                  parse_example)
from grain_elevator.tools.convert import features as features_lib

# tensorflow-datasets ships the generated proto and imports it without TensorFlow.
pb = pytest.importorskip("tensorflow_datasets.proto").tf_example_pb2

_INT64 = st.integers(-2**63, 2**63 - 1)
_FLOAT32 = st.floats(width=32, allow_nan=False)
_VALUES = st.one_of(
    st.lists(_INT64, min_size=1, max_size=6),
    st.lists(_FLOAT32, min_size=1, max_size=6).map(lambda v: np.array(v, np.float32)),
    st.lists(st.binary(max_size=20), min_size=1, max_size=4),
)
_FEATURES = st.dictionaries(st.text(max_size=8), _VALUES, max_size=5)


def to_proto(features: dict) -> "pb.Example":
  msg = pb.Example()
  for name, values in features.items():
    f = msg.features.feature[name]
    if isinstance(values, np.ndarray):
      f.float_list.value.extend(values.tolist())
    elif isinstance(values[0], bytes):
      f.bytes_list.value.extend(values)
    else:
      f.int64_list.value.extend(values)
  return msg


def from_proto(msg: "pb.Example") -> dict:
  out = {}
  for name, f in msg.features.feature.items():
    kind = f.WhichOneof("kind")
    if kind == "float_list":
      out[name] = np.array(f.float_list.value, np.float32)
    elif kind == "bytes_list":
      out[name] = list(f.bytes_list.value)
    elif kind == "int64_list":
      out[name] = np.array(f.int64_list.value, np.int64)
    else:
      out[name] = []
  return out


def assert_same(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    x, y = a[k], b[k]
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
      x = np.asarray(x, np.float32 if np.asarray(x).dtype.kind == "f" else None)
      y = np.asarray(y, x.dtype)
      assert x.tobytes() == y.tobytes(), k
    else:
      assert list(x) == list(y), k


def normalized(features: dict) -> dict:
  return {k: (v if isinstance(v, np.ndarray) or isinstance(v[0], bytes)
              else np.array(v, np.int64)) for k, v in features.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_FEATURES)
def test_round_trips_and_agrees_with_protobuf(features):
  ours = encode_example(features)
  assert_same(parse_example(ours), normalized(features))
  assert_same(from_proto(pb.Example.FromString(ours)), normalized(features))  # theirs reads ours
  theirs = to_proto(features).SerializeToString()
  assert_same(parse_example(theirs), normalized(features))  # ours reads theirs
  if len(features) <= 1:  # one feature: no map order to differ on, so the same bytes
    assert ours == to_proto(features).SerializeToString(deterministic=True)


def test_encoding_is_deterministic_in_key_order():
  a = encode_example({"b": [1], "a": [2.5], "c": [b"x"]})
  b = encode_example({"c": [b"x"], "a": [2.5], "b": [1]})
  assert a == b
  assert list(parse_example(a)) == ["a", "b", "c"]


def test_encode_value_forms():
  got = parse_example(encode_example({
      "scalar": 3, "text": "héllo", "f": 1.5, "arr": np.arange(6, dtype=np.uint8).reshape(2, 3),
      "bools": np.array([True, False]), "neg": -5, "empty": np.zeros(0, np.int64)}))
  assert got["scalar"].tolist() == [3] and got["text"] == ["héllo".encode()]
  assert got["f"].dtype == np.float32 and got["arr"].tolist() == list(range(6))
  assert got["bools"].tolist() == [1, 0] and got["neg"].tolist() == [-5]
  assert got["empty"].dtype == np.int64 and got["empty"].size == 0
  for bad in ([], [1, b"x"], np.array([2**64 - 1], np.uint64), [2**63]):
    with pytest.raises(ExampleError):
      encode_example({"x": bad})


def test_reads_unpacked_and_merged_encodings():
  """Valid protobuf encodings other than ours: unpacked numbers, a Features
  message twice, a feature entry repeated (the last wins), unknown fields."""
  entry = lambda name, feat: example._length_delimited(  # pylint: disable=protected-access
      1, example._length_delimited(1, name) + example._length_delimited(2, feat))
  ld = example._length_delimited  # pylint: disable=protected-access
  unpacked_ints = ld(3, b"\x08\x05\x08\x7f")  # two int64 values, unpacked (wire type 0)
  unpacked_floats = ld(2, b"\x0d" + np.float32(2.5).tobytes())
  unknown = b"\x98\x01\x07"  # field 19, varint
  msg = (ld(1, entry(b"a", unpacked_ints) + unknown) + ld(1, entry(b"b", unpacked_floats))
         + ld(1, entry(b"a", ld(1, ld(1, b"zz")))))
  ours = parse_example(msg)
  theirs = from_proto(pb.Example.FromString(msg))
  assert_same(ours, theirs)
  assert ours["a"] == [b"zz"] and ours["b"].tolist() == [2.5]


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_example_error(data):
  try:
    parse_example(data)
  except ExampleError:
    pass


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_FEATURES, st.data())
def test_damaged_examples_raise_only_example_error_or_agree(features, data):
  good = bytearray(encode_example(features))
  if not good:
    return
  how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
  at = data.draw(st.integers(0, len(good) - 1))
  if how == "flip":
    good[at] ^= 1 << data.draw(st.integers(0, 7))
  elif how == "cut":
    del good[at:]
  else:
    good[at:at] = data.draw(st.binary(min_size=1, max_size=4))
  try:
    ours = parse_example(bytes(good))
  except ExampleError:
    return
  # What we accept, protobuf accepts, with the same content. One known
  # difference: upb (protobuf's Python runtime) drops a map entry that holds an
  # unknown field; TensorFlow's parser keeps it, and so do we (the last entry
  # of a key wins, so such an entry may also replace an earlier one).
  theirs = from_proto(pb.Example.FromString(bytes(good)))
  if _has_entry_with_unknown_field(bytes(good)):
    return
  assert_same(ours, theirs)


def _has_entry_with_unknown_field(msg: bytes) -> bool:
  fields = example._fields  # pylint: disable=protected-access
  for f1, _, a, b in fields(msg, 0, len(msg), "Example"):
    if f1 == 1:
      for f2, _, c, d in fields(msg, a, b, "features"):
        if f2 == 1 and any(f3 not in (1, 2) for f3, *_ in fields(msg, c, d, "entry")):
          return True
  return False


def test_errors_name_the_field():
  with pytest.raises(ExampleError, match="varint"):
    parse_example(b"\x0a\x80")
  with pytest.raises(ExampleError, match="claims 5 bytes, 0 left"):
    parse_example(b"\x0a\x05")
  ld = example._length_delimited  # pylint: disable=protected-access
  bad_ints = ld(3, ld(1, b"\x80"))  # a packed varint cut short
  with pytest.raises(ExampleError, match="feature 'label': int64_list: a varint runs past"):
    parse_example(example.example_bytes([("label", bad_ints)]))
  with pytest.raises(ExampleError, match="feature 'f': float_list: packed floats of 3 bytes"):
    parse_example(example.example_bytes([("f", ld(2, ld(1, b"abc")))]))
  with pytest.raises(ExampleError, match="longer than 10 bytes"):
    parse_example(b"\x08" + b"\xff" * 11 + b"\x01")


# -- the features spec ----------------------------------------------------------------

def test_parse_examples_pipeline():
  import grain  # pylint: disable=g-import-not-at-top
  rows = [encode_example({
      "label": i, "emb": np.arange(4, dtype=np.float32) + i, "name": f"n{i}",
      "pixels": np.full((2, 3), i, np.uint8).tobytes(), "half": np.float16(i / 3).tobytes(),
      "small": [i, -i], "flag": [i % 2]}) for i in range(5)]
  spec = {"label": {"dtype": "int64", "shape": []},
          "emb": {"dtype": "float32", "shape": [2, 2]},
          "name": {"dtype": "S4", "shape": []},
          "pixels": {"dtype": "uint8", "shape": [2, 3]},
          "half": {"dtype": "float16", "shape": []},
          "small": {"dtype": "int8", "shape": [2]},
          "flag": {"dtype": "bool", "shape": []},
          "missing": {"dtype": "int32", "shape": [3], "default": 7},
          "raw": {"dtype": "bytes"}}
  rows = [r + encode_example({"raw": [b"a", b"b"]}) for r in rows]  # two Features merge
  ds = example.parse_examples(grain.MapDataset.source(rows), features=spec)
  got = list(ds)
  assert list(got[0]) == list(spec)
  for i, r in enumerate(got):
    assert r["label"].dtype == np.int64 and r["label"].shape == () and r["label"] == i
    assert r["emb"].shape == (2, 2) and r["emb"].ravel().tolist() == [i, i + 1, i + 2, i + 3]
    assert r["name"] == f"n{i}".encode() and r["name"].dtype == np.dtype("S4")
    assert r["pixels"].dtype == np.uint8 and (r["pixels"] == i).all()
    assert r["half"].tobytes() == np.float16(i / 3).tobytes()
    assert r["small"].dtype == np.int8 and r["small"].tolist() == [i, -i]
    assert r["flag"].dtype == np.bool_ and bool(r["flag"]) == bool(i % 2)
    assert r["missing"].tolist() == [7, 7, 7] and r["missing"].dtype == np.int32
    assert r["raw"] == [b"a", b"b"]


@pytest.mark.parametrize("spec,record,match", [
    ({"x": {"dtype": "int64", "shape": []}}, {"y": [1]}, "'x': missing"),
    ({"x": {"dtype": "int64", "shape": [2]}}, {"x": [1]}, "'x': 1 values, expected 2"),
    ({"x": {"dtype": "uint8", "shape": []}}, {"x": [300]}, "'x': a value is out of range"),
    ({"x": {"dtype": "float32"}}, {"x": [1]}, "'x': found an int64_list"),
    ({"x": {"dtype": "int64"}}, {"x": [1.5]}, "'x': found a float_list"),
    ({"x": {"dtype": "uint16", "shape": [2]}}, {"x": [b"abc"]}, "'x': 3 bytes, expected 4"),
    ({"x": {"dtype": "bytes", "shape": []}}, {"x": [b"a", b"b"]}, "'x': expected 1 value"),
    ({"x": {"dtype": "S2", "shape": []}}, {"x": [b"abc"]}, "'x'"),
])
def test_records_that_do_not_fit_the_spec(spec, record, match):
  with pytest.raises(ExampleError, match=match):
    ExampleParser(spec)(encode_example(record))


@pytest.mark.parametrize("spec,match", [
    ({}, "non-empty"),
    ({"x": {"shape": []}}, "'dtype' is required"),
    ({"x": {"dtype": "int64", "shap": []}}, "unknown key"),
    ({"x": {"dtype": "object"}}, "not supported"),
    ({"x": {"dtype": "nope"}}, "unknown dtype"),
    ({"x": {"dtype": "int64", "shape": [-1]}}, "shape"),
    ({"x": {"dtype": "bytes", "shape": [2]}}, "bytes"),
    ({"x": {"dtype": "int64", "default": 0}}, "needs a shape"),
    ({"x": {"dtype": "uint8", "shape": [], "default": 300}}, "default"),
])
def test_bad_specs_fail_at_once(spec, match):
  with pytest.raises(ExampleError, match=match):
    ExampleParser(spec)


def test_parser_pickles():
  import pickle  # pylint: disable=g-import-not-at-top
  p = pickle.loads(pickle.dumps(ExampleParser({"x": {"dtype": "int64", "shape": []}})))
  assert p(encode_example({"x": 4}))["x"] == 4


def test_serving_from_sample():
  sample = [encode_example({"label": i, "v": [1.0] * (1 + i % 2), "img": b"x"})
            for i in range(4)]
  s = features_lib.serving_from_sample(sample)
  f = s.options["features"]
  assert f["label"] == {"dtype": "int64", "shape": []}
  assert f["v"] == {"dtype": "float32"} and "not batchable" in s.feature_comments["v"]
  assert f["img"] == {"dtype": "bytes", "shape": []}
  assert features_lib.serving_from_sample([b"\xff\xfe"]).pipeline is None
