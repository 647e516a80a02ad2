"""`elevator convert parquet`: Parquet rows into tf.train.Example records.

One record per row (files in sorted name order, rows in file order), read a
batch of rows at a time so memory stays bounded by the batch, not the file.
Each column becomes a feature of the same name, stored so that
`example.parse_examples` with the features spec printed at the end gives
back exactly the column's values:

==========================================  ===========================  ==================
column type                                 stored as                    spec dtype
==========================================  ===========================  ==================
bool, int8..int64, uint8..uint32            int64_list                   the column's
float32                                     float_list                   float32
float16, float64, uint64                    one raw little-endian value  the column's
string, large_string                        bytes_list (UTF-8)           "S<longest>"
binary, large_binary                        bytes_list                   "bytes"
fixed_size_binary(n)                        one raw value                uint8, shape [n]
list / large_list / fixed_size_list of any  as its items, row flattened  the items', shape
of the above (fixed_size_list nested too)                                [n] when fixed
dictionary of the above                     as its values
==========================================  ===========================  ==================

A null row value leaves the feature out (the spec then gets a `default`);
a null inside a list, and any other type (struct, map, timestamp,
decimal...), fails naming the column. All files must have the same columns
and types.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

import numpy as np

from grain_elevator.pipelines import tf_example as example
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.errors import ConvertError
from grain_elevator.tools.convert.files import expand

DEFAULT_BATCH_ROWS = 1024


def _pa():
  try:
    import pyarrow  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ConvertError("reading Parquet needs pyarrow: pip install "
                       "'grain-elevator[convert]'") from None
  return pyarrow


@dataclasses.dataclass(frozen=True)
class Column:
  """How one column is stored: mode int | float | raw | str | bin."""

  name: str
  mode: str
  dtype: str | None  # numpy dtype name of the items (int, float, raw)
  shape: tuple[int, ...] | None  # per row; () scalar, None variable-length list
  list_depth: int  # list levels to flatten (0: scalar column)
  raw_items: int = 1  # fixed_size_binary(n): n uint8 items per value


def _column(name: str, t: Any) -> Column:
  pa = _pa()
  types = pa.types
  shape: list[int] | None = []
  depth = 0
  while True:
    if types.is_dictionary(t):
      t = t.value_type
      continue
    if types.is_fixed_size_list(t):
      if shape is not None:
        shape.append(t.list_size)
      t, depth = t.value_type, depth + 1
      continue
    if types.is_list(t) or types.is_large_list(t):
      if depth:
        raise ConvertError(f"column {name!r}: a variable-length list inside a list is not "
                           "supported")
      shape, t, depth = None, t.value_type, depth + 1
      continue
    break
  shape_t = None if shape is None else tuple(shape)
  if types.is_boolean(t):
    return Column(name, "int", "bool", shape_t, depth)
  if types.is_integer(t):
    dtype = f"{'int' if types.is_signed_integer(t) else 'uint'}{t.bit_width}"
    return Column(name, "raw" if dtype == "uint64" else "int", dtype, shape_t, depth)
  if types.is_float32(t):
    return Column(name, "float", "float32", shape_t, depth)
  if types.is_float16(t) or types.is_float64(t):
    return Column(name, "raw", "float16" if types.is_float16(t) else "float64", shape_t, depth)
  if types.is_string(t) or types.is_large_string(t):
    return Column(name, "str", None, shape_t, depth)
  if types.is_fixed_size_binary(t):
    if depth:
      raise ConvertError(f"column {name!r}: lists of fixed_size_binary are not supported")
    return Column(name, "raw", "uint8", (t.byte_width,), 0, raw_items=t.byte_width)
  if types.is_binary(t) or types.is_large_binary(t):
    return Column(name, "bin", None, shape_t, depth)
  raise ConvertError(f"column {name!r} has type {t}, which an Example cannot hold "
                     "exactly; supported: bool, integers, floats, string, binary and "
                     "lists of them (cast or drop the column first)")


def _columns(schema: Any) -> tuple[Column, ...]:
  return tuple(_column(f.name, f.type) for f in schema)


@dataclasses.dataclass(frozen=True)
class Segment:
  path: str
  start: int
  stop: int
  row_groups: tuple[int, ...]  # rows per row group


@dataclasses.dataclass(frozen=True)
class ParquetSource:
  patterns: tuple[str, ...]
  batch_rows: int = DEFAULT_BATCH_ROWS
  kind = "parquet"

  def __post_init__(self):
    if self.batch_rows < 1:
      raise ConvertError("--batch-rows must be >= 1")

  def units(self) -> list[str]:
    return expand(self.patterns)

  def index(self, unit: str) -> shards.Indexed:
    pa = _pa()
    try:
      pf = pa.parquet.ParquetFile(unit)
    except (OSError, pa.ArrowException) as e:
      raise ConvertError(f"{unit}: not a readable Parquet file: {e}") from e
    with pf:
      md = pf.metadata
      groups = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
      schema = pf.schema_arrow
    try:
      columns = _columns(schema)
    except ConvertError as e:
      raise ConvertError(f"{unit}: {e}") from e
    if len({c.name for c in columns}) != len(columns):
      raise ConvertError(f"{unit}: column names repeat")
    import os  # pylint: disable=g-import-not-at-top
    return shards.Indexed(sum(groups), os.path.getsize(unit), (groups, columns))

  def check(self, indexes: Sequence[tuple[str, shards.Indexed]]) -> None:
    if not indexes:
      return
    first_path, first = indexes[0]
    for path, ix in indexes[1:]:
      if ix.data[1] != first.data[1]:
        a = {c.name: c for c in first.data[1]}
        b = {c.name: c for c in ix.data[1]}
        diff = sorted(set(a) ^ set(b)) or [n for n in a if a[n] != b.get(n)]
        raise ConvertError(f"{path}: its columns differ from {first_path}'s "
                           f"(column {diff[0]!r}); all files need one schema")

  def segment(self, unit: str, indexed: shards.Indexed, start: int, stop: int) -> Segment:
    return Segment(unit, start, stop, indexed.data[0])

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    pa = _pa()
    with pa.parquet.ParquetFile(segment.path) as pf:
      columns = _columns(pf.schema_arrow)
      row = 0  # file row of the next batch
      for g, rows in enumerate(segment.row_groups):
        if row + rows <= segment.start or row >= segment.stop:
          row += rows
          continue
        for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=[g],
                                     use_threads=False):
          n = batch.num_rows
          a, b = max(segment.start - row, 0), min(segment.stop - row, n)
          if a < b:
            yield from _encode_batch(batch.slice(a, b - a), columns, stats,
                                     segment.path, row + a)
          row += n
          if row >= segment.stop:
            return

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, dict[str, int]] = {}
    for s in stats:
      for name, c in s.items():
        m = out.setdefault(name, {"nulls": 0, "min_len": c["min_len"], "max_len": 0,
                                  "max_bytes": 0})
        m["nulls"] += c["nulls"]
        m["min_len"] = min(m["min_len"], c["min_len"])
        m["max_len"] = max(m["max_len"], c["max_len"])
        m["max_bytes"] = max(m["max_bytes"], c["max_bytes"])
    return out

  def side_files(self) -> dict[str, bytes]:
    return {}

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    (first,) = self.units()[:1]
    with _pa().parquet.ParquetFile(first) as pf:
      columns = _columns(pf.schema_arrow)
    return serving_for(columns, stats)


def serving_for(columns: Sequence[Column], stats: dict[str, Any]) -> snippet_lib.Serving:
  features: dict[str, Any] = {}
  notes: dict[str, str] = {}
  for c in columns:
    s = stats.get(c.name, {"nulls": 0, "min_len": 0, "max_len": 0, "max_bytes": 0})
    shape = c.shape
    if shape is None and s["min_len"] == s["max_len"]:
      shape = (s["max_len"],)
    if c.mode == "str":
      dtype = f"S{max(1, s['max_bytes'])}"
    elif c.mode == "bin":
      dtype = "bytes"
      notes[c.name] = "bytes: decode in a further pipeline step (not servable as is)"
      if shape:
        shape = None
    else:
      dtype = c.dtype
    spec: dict[str, Any] = {"dtype": dtype}
    if shape is not None:
      spec["shape"] = list(shape)
    elif c.mode != "bin":
      notes[c.name] = (f"{s['min_len']} to {s['max_len']} items per row: not batchable "
                       "as is")
    if s["nulls"]:
      if shape is None:
        notes[c.name] = f"{s['nulls']} null rows and no fixed shape: give a shape and default"
      else:
        spec["default"] = "" if c.mode in ("str", "bin") else 0
        notes[c.name] = f"{s['nulls']} null rows: they get the default"
    features[c.name] = spec
  return snippet_lib.Serving(
      pipeline="grain_elevator.pipelines.tf_example:parse_examples",
      options={"features": features},
      comments=("records: tf.train.Example, one per row; the spec gives back each "
                "column's values",),
      feature_comments=notes)


def _encode_batch(batch: Any, columns: Sequence[Column], stats: dict[str, Any],
                  path: str, first_row: int) -> Iterator[bytes]:
  n = batch.num_rows
  per_column = [
      (c.name, _column_features(c, batch.column(i), stats, path, first_row))
      for i, c in enumerate(columns)]
  for r in range(n):
    yield example.example_bytes(
        [(name, feats[r]) for name, feats in per_column if feats[r] is not None])


def _column_features(c: Column, array: Any, stats: dict[str, Any], path: str,
                     first_row: int) -> list[bytes | None]:
  """The serialized Feature of each row of one column (None: a null row)."""
  pa = _pa()
  where = f"{path}: column {c.name!r}"
  if pa.types.is_dictionary(array.type):
    array = array.dictionary_decode()
  n = len(array)
  valid = (np.ones(n, bool) if array.null_count == 0
           else ~np.asarray(array.is_null().to_numpy(zero_copy_only=False)))
  # Row r's items are values[bounds[r]:bounds[r + 1]].
  values = array
  bounds = np.arange(n + 1, dtype=np.int64)
  for _ in range(c.list_depth):
    if pa.types.is_fixed_size_list(values.type):
      size = values.type.list_size  # null slots keep their children: take them all
      children = values.values.slice(values.offset * size, len(values) * size)
      inner = np.arange(len(values) + 1, dtype=np.int64) * size
    else:
      offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
      children = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
      inner = offsets - offsets[0]
    values = children
    bounds = inner[bounds]
  if pa.types.is_dictionary(values.type):
    values = values.dictionary_decode()
  if values.null_count:
    nulls = np.concatenate([[0], np.cumsum(
        np.asarray(values.is_null().to_numpy(zero_copy_only=False)))])
    bad = valid & (nulls[bounds[1:]] > nulls[bounds[:-1]])
    if bad.any():
      row = int(np.argmax(bad))
      raise ConvertError(f"{where}: row {first_row + row} holds a null inside a list; "
                         "Examples cannot hold one (fill it first)")
  s = stats.setdefault(c.name, {"nulls": 0, "min_len": math.inf, "max_len": 0,
                                "max_bytes": 0})
  s["nulls"] += int(n - valid.sum())
  if c.list_depth and c.shape is None and n:
    counts = np.diff(bounds)[valid] if valid.any() else np.zeros(1, np.int64)
    s["min_len"] = min(s["min_len"], int(counts.min()))
    s["max_len"] = max(s["max_len"], int(counts.max()))
  elif s["min_len"] == math.inf:
    s["min_len"] = 0
  out: list[bytes | None] = [None] * n
  if c.mode in ("str", "bin"):
    items = values.cast(pa.large_binary()).to_pylist()
    if c.mode == "str" and items:
      s["max_bytes"] = max(s["max_bytes"], max(map(len, items)))
    for r in range(n):
      if valid[r]:
        out[r] = example.feature_bytes(example.BYTES, items[bounds[r]:bounds[r + 1]])
    return out
  if c.raw_items > 1:  # fixed_size_binary: one raw value per row
    items = values.to_pylist()
    for r in range(n):
      if valid[r]:
        out[r] = example.feature_bytes(example.BYTES, [items[r]])
    return out
  if values.null_count:  # children of null rows only (checked above)
    values = values.fill_null(pa.scalar(False if c.dtype == "bool" else 0, values.type))
  items = (np.asarray(values.to_numpy(zero_copy_only=False)) if len(values)
           else np.zeros(0, c.dtype))
  if c.mode == "raw":
    items = items.astype(np.dtype(c.dtype).newbyteorder("<"), copy=False)
    for r in range(n):
      if valid[r]:
        out[r] = example.feature_bytes(example.BYTES, [items[bounds[r]:bounds[r + 1]].tobytes()])
    return out
  kind = example.INT64 if c.mode == "int" else example.FLOAT
  if kind == example.INT64:
    items = items.astype(np.int64, copy=False)
  for r in range(n):
    if valid[r]:
      out[r] = example.feature_bytes(kind, items[bounds[r]:bounds[r + 1]])
  return out
