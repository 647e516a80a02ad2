"""`tf.train.Example` without TensorFlow or protobuf: a hand-written codec of
its wire format, and `parse_examples`, the pipeline that turns Example
records into numpy arrays for serving.

The messages (tensorflow/core/example/{example,feature}.proto):

  Example  { Features features = 1; }
  Features { map<string, Feature> feature = 1; }
  Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                          Int64List int64_list = 3; } }
  BytesList { repeated bytes value = 1; }
  FloatList { repeated float value = 1 [packed = true]; }
  Int64List { repeated int64 value = 1 [packed = true]; }

`encode_example` writes exactly protobuf's deterministic serialization
(features in key order), so the same dict always gives the same bytes.
`parse_example` reads any valid encoding (fields in any order, repeated
messages merged, packed or unpacked numbers, unknown fields skipped) and is
a parser of untrusted bytes: every length and varint is bounded by the bytes
that are there, and malformed input raises `ExampleError` naming the field.

A features spec (``[datasets.NAME.options.features]`` in a config) maps a
feature name to ``{dtype = ..., shape = [...], default = ...}``:

* ``dtype = "int64"`` (or any integer/bool dtype) reads an int64_list, range
  checked; ``"float32"`` (or another float dtype) a float_list.
* any numpy dtype (``"uint8"``, ``"float16"``, ``"float64"``, ``"<U5"`` ...)
  also reads a bytes_list holding ONE value: the array's raw little-endian
  C-order bytes (how `elevator convert npz` and `parquet` store what an
  int64/float list cannot hold exactly).
* ``"S<n>"`` (fixed-size bytes, numpy's NUL-padded strings) reads a
  bytes_list of values of at most n bytes each.
* ``"bytes"`` gives the bytes_list's values as Python ``bytes`` (``shape =
  []``: exactly one value) or a list of them (no shape). These cannot go on
  the wire as they are: a further pipeline step must decode them (images,
  text) into arrays.
* ``shape`` is required for batching (fixed shapes); without it a numeric
  feature is a 1-D array of whatever length each record has.
* ``default`` (with a shape) fills a feature a record lacks; without it a
  missing feature is an error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from grain_elevator.proto import varint

if TYPE_CHECKING:  # not imported at run time: the converter's Beam environment has no Grain
  import grain

BYTES, FLOAT, INT64 = "bytes_list", "float_list", "int64_list"
_KIND_FIELD = {BYTES: 1, FLOAT: 2, INT64: 3}
_FIELD_KIND = {v: k for k, v in _KIND_FIELD.items()}
_U64 = (1 << 64) - 1
_SPEC_KEYS = {"dtype", "shape", "default"}


class ExampleError(ValueError):
  """An Example record or a features spec is malformed; names the field."""


# -- encoding -------------------------------------------------------------------------


_varint = varint.encode


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _int64_payload(values: np.ndarray) -> bytes:
  if values.size and values.min() >= 0 and values.max() < 0x80:
    return values.astype(np.uint8).tobytes()
  return b"".join(_varint(int(v) & _U64) for v in values.tolist())


def feature_bytes(kind: str, values: Any) -> bytes:
  """One serialized `Feature` of `kind` (BYTES, FLOAT, INT64) holding `values`
  (bytes objects; or anything numpy turns into float32/int64 numbers)."""
  if kind == BYTES:
    payload = b"".join(_length_delimited(1, bytes(v)) for v in values)
  elif kind == FLOAT:
    packed = np.asarray(values, dtype="<f4").tobytes()
    payload = _length_delimited(1, packed) if packed else b""
  elif kind == INT64:
    packed = _int64_payload(np.asarray(values, dtype=np.int64).reshape(-1))
    payload = _length_delimited(1, packed) if packed else b""
  else:
    raise ValueError(f"unknown feature kind {kind!r}")
  return _length_delimited(_KIND_FIELD[kind], payload)


def example_bytes(features: Sequence[tuple[str, bytes]]) -> bytes:
  """An `Example` from (name, serialized Feature) pairs, in name order."""
  entries = b"".join(
      _length_delimited(1, _length_delimited(1, name.encode()) + _length_delimited(2, f))
      for name, f in sorted(features, key=lambda kv: kv[0].encode()))
  return _length_delimited(1, entries) if features else b""


def _kind_of(name: str, values: Any) -> tuple[str, Any]:
  if isinstance(values, (bytes, str, int, float, np.generic)) and not isinstance(values, np.ndarray):
    values = [values]
  if isinstance(values, np.ndarray):
    if values.dtype.kind in "iub":
      if values.dtype == np.uint64 and values.size and int(values.max()) > 2**63 - 1:
        raise ExampleError(f"feature {name!r}: uint64 values over 2**63-1 do not fit int64")
      return INT64, values.reshape(-1)
    if values.dtype.kind == "f":
      return FLOAT, values.reshape(-1)
    if values.dtype.kind in "SO":
      values = values.reshape(-1).tolist()
    else:
      raise ExampleError(f"feature {name!r}: cannot store dtype {values.dtype} in an Example")
  values = list(values)
  if not values:
    raise ExampleError(f"feature {name!r}: an empty list has no kind; give a typed "
                       "numpy array (int64, float32 or bytes)")
  if all(isinstance(v, (bytes, bytearray, memoryview, str, np.bytes_)) for v in values):
    return BYTES, [v.encode() if isinstance(v, str) else bytes(v) for v in values]
  if all(isinstance(v, (int, np.integer, bool, np.bool_)) for v in values):
    for v in values:
      if not -2**63 <= int(v) < 2**63:
        raise ExampleError(f"feature {name!r}: {v} does not fit int64")
    return INT64, values
  if all(isinstance(v, (int, float, np.integer, np.floating, bool, np.bool_)) for v in values):
    return FLOAT, values
  raise ExampleError(f"feature {name!r}: values must be all bytes/str, all ints or all "
                     f"numbers, got {[type(v).__name__ for v in values[:3]]}")


def encode_example(features: Mapping[str, Any]) -> bytes:
  """Serializes a `tf.train.Example`, exactly as protobuf's deterministic
  serialization does (features in key order).

  Values: lists or numpy arrays (flattened) of ints or bools (int64_list),
  floats (float_list, as float32), bytes or str (bytes_list, str as UTF-8);
  a scalar is a one-element list.

  >>> encode_example({"label": 3, "image": b"\\xff\\xd8..."})
  """
  return example_bytes([(name, feature_bytes(*_kind_of(name, v)))
                        for name, v in features.items()])


# -- decoding -------------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int, end: int, where: str) -> tuple[int, int]:
  try:
    return varint.decode(buf, pos, end)
  except ValueError as e:
    raise ExampleError(f"{where}: {e} (byte {pos})") from None


def _fields(buf: bytes, pos: int, end: int, where: str) -> Iterator[tuple[int, int, int, int]]:
  """(field number, wire type, start, end-or-value) of each field in
  buf[pos:end]: for wire type 2 the payload's [start, end); for 0 the value."""
  while pos < end:
    tag, pos = _read_varint(buf, pos, end, where)
    field, wire = tag >> 3, tag & 7
    if field == 0 or field > 0x1FFFFFFF:
      raise ExampleError(f"{where}: invalid field number {field} (byte {pos})")
    if wire == 0:
      value, pos = _read_varint(buf, pos, end, where)
      yield field, wire, pos, value
    elif wire == 2:
      n, pos = _read_varint(buf, pos, end, where)
      if n > end - pos:
        raise ExampleError(f"{where}: field {field} claims {n} bytes, {end - pos} left "
                           f"(byte {pos})")
      yield field, wire, pos, pos + n
      pos += n
    elif wire == 1 or wire == 5:
      n = 8 if wire == 1 else 4
      if n > end - pos:
        raise ExampleError(f"{where}: field {field} runs past the end (byte {pos})")
      yield field, wire, pos, pos + n
      pos += n
    else:
      raise ExampleError(f"{where}: field {field} has unsupported wire type {wire} "
                         f"(byte {pos})")


def _ints(buf: bytes, start: int, end: int, where: str, out: list[Any]) -> None:
  chunk = buf[start:end]
  if chunk.isascii():  # every varint one byte: no Python loop
    out.append(np.frombuffer(chunk, dtype=np.uint8).astype(np.int64))
    return
  values = []
  pos = start
  while pos < end:
    v, pos = _read_varint(buf, pos, end, where)
    values.append(v - (1 << 64) if v >> 63 else v)
  out.append(np.array(values, dtype=np.int64))


def _parse_list(buf: bytes, start: int, end: int, kind: str, where: str, out: list[Any]) -> None:
  where = f"{where}: {kind}"
  for field, wire, a, b in _fields(buf, start, end, where):
    if field != 1:
      continue  # unknown field
    if kind == BYTES:
      if wire != 2:
        raise ExampleError(f"{where}: value has wire type {wire}, expected 2")
      out.append(buf[a:b])
    elif kind == FLOAT:
      if wire == 2:
        if (b - a) % 4:
          raise ExampleError(f"{where}: packed floats of {b - a} bytes (not a multiple of 4)")
        out.append(np.frombuffer(buf, dtype="<f4", count=(b - a) // 4, offset=a))
      elif wire == 5:
        out.append(np.frombuffer(buf, dtype="<f4", count=1, offset=a))
      else:
        raise ExampleError(f"{where}: value has wire type {wire}, expected 2 or 5")
    else:
      if wire == 2:
        _ints(buf, a, b, where, out)
      elif wire == 0:
        out.append(np.array([b - (1 << 64) if b >> 63 else b], dtype=np.int64))
      else:
        raise ExampleError(f"{where}: value has wire type {wire}, expected 0 or 2")


def _parse_feature(buf: bytes, start: int, end: int, where: str) -> tuple[str | None, list[Any]]:
  kind, parts = None, []
  for field, wire, a, b in _fields(buf, start, end, where):
    if field not in _FIELD_KIND:
      continue
    if wire != 2:
      raise ExampleError(f"{where}: field {field} has wire type {wire}, expected 2")
    new = _FIELD_KIND[field]
    if new != kind:  # another member of the oneof replaces the last one
      kind, parts = new, []
    _parse_list(buf, a, b, new, where, parts)
  return kind, parts


def values_of(kind: str | None, parts: list[Any]) -> list[bytes] | np.ndarray:
  """A feature's values from what `parse_raw` found: an int64 or float32
  array, or the bytes_list's values."""
  if kind == BYTES:
    return parts
  if kind is None:
    return []
  dtype = np.float32 if kind == FLOAT else np.int64
  if not parts:
    return np.zeros(0, dtype)
  return parts[0].astype(dtype) if len(parts) == 1 else np.concatenate(parts).astype(dtype)


def parse_raw(record: bytes) -> dict[str, tuple[str | None, list[Any]]]:
  """name -> (kind, parts) of an Example: the parser behind parse_example."""
  buf = bytes(record)
  found: dict[str, tuple[str | None, list[Any]]] = {}
  for field, wire, a, b in _fields(buf, 0, len(buf), "Example"):
    if field != 1:
      continue
    if wire != 2:
      raise ExampleError(f"Example: field 1 (features) has wire type {wire}, expected 2")
    for f2, w2, c, d in _fields(buf, a, b, "Example.features"):
      if f2 != 1:
        continue
      if w2 != 2:
        raise ExampleError(f"Example.features: field 1 has wire type {w2}, expected 2")
      name, value = "", None
      for f3, w3, e, g in _fields(buf, c, d, "Example.features entry"):
        if f3 not in (1, 2):
          continue
        if w3 != 2:
          raise ExampleError(f"Example.features entry: field {f3} has wire type {w3}, "
                             "expected 2")
        if f3 == 1:
          try:
            name = buf[e:g].decode("utf-8")
          except UnicodeDecodeError as err:
            raise ExampleError(f"Example.features: a feature name is not UTF-8 "
                               f"(byte {e})") from err
        else:
          value = (value or []) + [(e, g)]
      kind, parts = None, []
      for e, g in value or ():  # a repeated message field merges into one
        k, p = _parse_feature(buf, e, g, f"feature {name!r}")
        if k is not None and k != kind:
          kind, parts = k, []
        parts += p
      found[name] = (kind, parts)  # the last entry of a key wins
  return found


def parse_example(record: bytes) -> dict[str, list[bytes] | np.ndarray]:
  """A serialized `tf.train.Example` -> {name: values}: int64 and float32
  numpy arrays, lists of bytes. Raises ExampleError on malformed input."""
  return {name: values_of(kind, parts) for name, (kind, parts) in parse_raw(record).items()}


# -- features spec and the pipeline ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  name: str
  dtype: np.dtype | None  # None: "bytes"
  shape: tuple[int, ...] | None
  default: Any = None
  has_default: bool = False

  @classmethod
  def of(cls, name: str, spec: Any) -> "FeatureSpec":
    where = f"features: {name!r}"
    if not isinstance(spec, Mapping):
      raise ExampleError(f"{where}: must be a table like {{dtype = \"int64\", shape = []}}, "
                         f"got {spec!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
      raise ExampleError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_SPEC_KEYS)}")
    if "dtype" not in spec:
      raise ExampleError(f"{where}: key 'dtype' is required")
    text = spec["dtype"]
    if not isinstance(text, str):
      raise ExampleError(f"{where}: dtype must be a string, got {text!r}")
    dtype = None
    if text != "bytes":
      try:
        dtype = np.dtype(text)
      except TypeError as e:
        raise ExampleError(f"{where}: unknown dtype {text!r}") from e
      if dtype.kind in "OV":
        raise ExampleError(f"{where}: dtype {text!r} is not supported")
      if dtype.byteorder == ">":
        raise ExampleError(f"{where}: dtype {text!r}: values are little-endian")
      dtype = dtype.newbyteorder("<") if dtype.byteorder == "=" else dtype
    shape = spec.get("shape")
    if shape is not None:
      if not isinstance(shape, (list, tuple)) or not all(
          isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ExampleError(f"{where}: shape must be a list of sizes >= 0, got {shape!r}")
      shape = tuple(shape)
      if dtype is None and shape:
        raise ExampleError(f"{where}: a \"bytes\" feature has shape [] (one value) or no "
                           "shape (a list); for fixed-size arrays give a numpy dtype")
    has_default = "default" in spec
    default = spec.get("default")
    if has_default:
      if shape is None:
        raise ExampleError(f"{where}: a default needs a shape")
      if dtype is None:
        if not isinstance(default, (str, bytes)):
          raise ExampleError(f"{where}: default must be a string")
        default = default.encode() if isinstance(default, str) else default
      else:
        try:
          default = np.full(shape, default, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as e:
          raise ExampleError(f"{where}: default {spec['default']!r} is not a {text}") from e
        default.setflags(write=False)
    return cls(name, dtype, shape, default, has_default)

  def decode(self, kind: str | None, parts: list[Any]) -> Any:
    where = f"feature {self.name!r}"
    dtype, shape = self.dtype, self.shape
    if dtype is None:
      if kind not in (BYTES, None):
        raise ExampleError(f"{where}: expected a bytes_list, found an {kind}")
      if shape == ():
        if len(parts) != 1:
          raise ExampleError(f"{where}: expected 1 value (shape []), got {len(parts)}")
        return parts[0]
      return list(parts)
    want = None if shape is None else math.prod(shape)
    if kind == BYTES:
      if dtype.kind == "S" and (want is None or len(parts) == want) and all(
          len(p) <= dtype.itemsize for p in parts) and not (
              want is None and len(parts) == 1 and len(parts[0]) > dtype.itemsize):
        a = np.array(parts, dtype=dtype) if parts else np.zeros(0, dtype)
      else:  # raw little-endian bytes of the whole array
        if len(parts) != 1:
          raise ExampleError(f"{where}: a bytes_list must hold one value (the raw bytes "
                             f"of a {dtype} array), got {len(parts)}")
        raw = parts[0]
        if want is not None and len(raw) != want * dtype.itemsize:
          raise ExampleError(f"{where}: {len(raw)} bytes, expected {want * dtype.itemsize} "
                             f"for {dtype}{list(shape)}")
        if len(raw) % dtype.itemsize:
          raise ExampleError(f"{where}: {len(raw)} bytes are not a whole number of {dtype}")
        a = np.frombuffer(raw, dtype=dtype)
    elif kind == INT64 or kind == FLOAT or kind is None:
      a = values_of(kind, parts) if kind else np.zeros(0, dtype)
      if kind == INT64:
        if dtype.kind not in "iub":
          raise ExampleError(f"{where}: found an int64_list, but dtype is {dtype}")
        if dtype.kind != "b" and dtype != np.int64 and a.size:
          info = np.iinfo(dtype)
          if a.min() < info.min or a.max() > info.max:
            raise ExampleError(f"{where}: a value is out of range for {dtype}")
        if dtype.kind == "b" and a.size and (a.min() < 0 or a.max() > 1):
          raise ExampleError(f"{where}: a bool value other than 0 or 1")
        if dtype.kind == "u" and dtype.itemsize == 8 and a.size and a.min() < 0:
          raise ExampleError(f"{where}: a negative value for {dtype}")
      elif kind == FLOAT and dtype.kind != "f":
        raise ExampleError(f"{where}: found a float_list, but dtype is {dtype}")
      a = a.astype(dtype, copy=False)
    else:
      raise ExampleError(f"{where}: unknown kind {kind}")
    if shape is not None:
      if a.size != want:
        raise ExampleError(f"{where}: {a.size} values, expected {want} for shape "
                           f"{list(shape)}")
      a = a.reshape(shape)
    return a


class ExampleParser:
  """record bytes -> {name: numpy array (or bytes)} for a features spec;
  picklable, so Grain can run it in worker processes."""

  def __init__(self, features: Mapping[str, Any]):
    if not isinstance(features, Mapping) or not features:
      raise ExampleError("features must be a non-empty table of "
                         "name = {dtype = ..., shape = [...]}")
    self.features = dict(features)
    self._specs = [FeatureSpec.of(str(k), v) for k, v in features.items()]

  def __getstate__(self):
    return {"features": self.features}

  def __setstate__(self, state):
    self.__init__(state["features"])

  def __call__(self, record: bytes) -> dict[str, Any]:
    found = parse_raw(record)
    out = {}
    for spec in self._specs:
      got = found.get(spec.name)
      if got is None:
        if not spec.has_default:
          raise ExampleError(f"feature {spec.name!r}: missing from a record (it has "
                             f"{sorted(found)[:8]}); give the spec a default")
        out[spec.name] = spec.default
      else:
        out[spec.name] = spec.decode(*got)
    return out


def parse_examples(ds: grain.MapDataset, *, features: Mapping[str, Any]) -> grain.MapDataset:
  """Pipeline: Example records -> dicts of numpy arrays, per a features spec.

  In a config:

    [datasets.train]
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.pipelines.tf_example:parse_examples"
    [datasets.train.options.features]
    label = { dtype = "int64", shape = [] }
    embedding = { dtype = "float32", shape = [128] }
    pixels = { dtype = "uint8", shape = [28, 28] }   # raw bytes

  Args:
    ds: a `grain.MapDataset` of serialized Examples.
    features: name -> {dtype, shape, default} (the module docstring).
  Returns:
    `ds` mapped to {name: value}, in the spec's order.
  Raises:
    ExampleError: at once for a bad spec; per record for one that does not
      match it (naming the feature).
  """
  return ds.map(ExampleParser(features))
