"""`elevator convert npz`: rows of .npz arrays into tf.train.Example records.

Each .npz holds named arrays with one leading dimension (the rows); every
file holds the same names, dtypes and row shapes. Record i of a file is an
Example with one feature per array: ONE bytes value, the row's raw
little-endian C-order bytes. So every dtype comes back bit for bit (uint8,
int8, float16, bool, complex, fixed-size strings...), through
`example.parse_examples` with the spec printed at the end
(``name = {dtype = "<the array's dtype>", shape = <its row shape>}``).

Files are opened with ``allow_pickle=False`` semantics (object arrays are
refused) and read a chunk of rows at a time: memory stays bounded by the
chunk, not the file (Fortran-ordered arrays are the exception: read whole).
Records are ordered by file name, then row.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Any, Iterator, Sequence

import numpy as np

from grain_elevator.pipelines import tf_example as example
from grain_elevator.proto.dtypes import dtype_to_str
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.errors import ConvertError
from grain_elevator.tools.convert.files import expand

_CHUNK_BYTES = 8 << 20
_MAX_HEADER = 10000  # bytes of an .npy header (numpy's own default limit)


@dataclasses.dataclass(frozen=True)
class Array:
  name: str  # the feature name (the .npz key)
  member: str  # the zip member
  dtype: str  # numpy dtype string
  row_shape: tuple[int, ...]
  fortran: bool


def _header(f: Any, where: str) -> tuple[np.dtype, tuple[int, ...], bool]:
  fmt = np.lib.format
  try:
    version = fmt.read_magic(f)
    if version == (1, 0):
      shape, fortran, dtype = fmt.read_array_header_1_0(f, max_header_size=_MAX_HEADER)
    elif version == (2, 0):
      shape, fortran, dtype = fmt.read_array_header_2_0(f, max_header_size=_MAX_HEADER)
    else:
      shape, fortran, dtype = fmt._read_array_header(f, version, max_header_size=_MAX_HEADER)  # pylint: disable=protected-access
  except (ValueError, OSError, EOFError, SyntaxError) as e:
    raise ConvertError(f"{where}: not a readable .npy header: {e}") from e
  return dtype, shape, fortran


def _arrays(path: str) -> tuple[int, tuple[Array, ...]]:
  try:
    zf = zipfile.ZipFile(path)
  except (OSError, zipfile.BadZipFile) as e:
    raise ConvertError(f"{path}: not a readable .npz file: {e}") from e
  rows = None
  out = []
  with zf:
    for member in sorted(zf.namelist()):
      if not member.endswith(".npy"):
        continue
      name = member[:-4]
      where = f"{path}: array {name!r}"
      with zf.open(member) as f:
        dtype, shape, fortran = _header(f, where)
      if dtype.hasobject or dtype.kind == "V":
        raise ConvertError(f"{where}: dtype {dtype} is not supported (object arrays need "
                           "pickle, which is never used)")
      if not shape:
        raise ConvertError(f"{where}: a 0-d array has no rows")
      if rows is None:
        rows = shape[0]
      elif shape[0] != rows:
        raise ConvertError(f"{where}: {shape[0]} rows where the file's other arrays have "
                           f"{rows}; every array needs the same leading dimension")
      out.append(Array(name, member, dtype.str, tuple(shape[1:]), fortran))
  if rows is None:
    raise ConvertError(f"{path}: holds no arrays")
  return rows, tuple(out)


def _signature(arrays: Sequence[Array]) -> tuple[Any, ...]:
  return tuple((a.name, a.dtype, a.row_shape) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Segment:
  path: str
  start: int
  stop: int


@dataclasses.dataclass(frozen=True)
class NpzSource:
  patterns: tuple[str, ...]
  kind = "npz"

  def units(self) -> list[str]:
    return expand(self.patterns)

  def index(self, unit: str) -> shards.Indexed:
    rows, arrays = _arrays(unit)
    return shards.Indexed(rows, os.path.getsize(unit), arrays)

  def check(self, indexes: Sequence[tuple[str, shards.Indexed]]) -> None:
    first_path, first = indexes[0]
    want = _signature(first.data)
    for path, ix in indexes[1:]:
      got = _signature(ix.data)
      if got != want:
        diff = next((b for a, b in zip(want, got) if a != b), None) or (got + want)[0]
        raise ConvertError(f"{path}: array {diff[0]!r} differs from {first_path}'s arrays "
                           f"(names, dtypes and row shapes must match: "
                           f"{[f'{n}:{d}{list(s)}' for n, d, s in got]} vs "
                           f"{[f'{n}:{d}{list(s)}' for n, d, s in want]})")

  def segment(self, unit: str, indexed: shards.Indexed, start: int, stop: int) -> Segment:
    return Segment(unit, start, stop)

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    _, arrays = _arrays(segment.path)
    row_bytes = sum(np.dtype(a.dtype).itemsize * int(np.prod(a.row_shape, dtype=np.int64))
                    for a in arrays)
    chunk = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    with zipfile.ZipFile(segment.path) as zf:
      readers = [_RowReader(zf, a, segment.path) for a in arrays]
      try:
        for r in readers:
          r.seek(segment.start)
        row = segment.start
        while row < segment.stop:
          k = min(chunk, segment.stop - row)
          blocks = [r.read(k) for r in readers]
          for i in range(k):
            yield example.example_bytes(
                [(a.name, example.feature_bytes(example.BYTES, [b[i:i + 1].tobytes()]))
                 for a, b in zip(arrays, blocks)])
          row += k
      finally:
        for r in readers:
          r.close()

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {}

  def side_files(self) -> dict[str, bytes]:
    return {}

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    _, arrays = _arrays(self.units()[0])
    features = {a.name: {"dtype": dtype_to_str(np.dtype(a.dtype)),
                         "shape": list(a.row_shape)} for a in arrays}
    return snippet_lib.Serving(
        pipeline="grain_elevator.pipelines.tf_example:parse_examples",
        options={"features": features},
        comments=("records: tf.train.Example, one per row; each array's row as raw "
                  "little-endian bytes",))


class _RowReader:
  """Rows of one .npy member of a zip, read in order a chunk at a time."""

  def __init__(self, zf: zipfile.ZipFile, array: Array, path: str):
    self.array = array
    self.where = f"{path}: array {array.name!r}"
    self.dtype = np.dtype(array.dtype)
    self.little = self.dtype.newbyteorder("<") if self.dtype.byteorder == ">" else self.dtype
    self.row_items = int(np.prod(array.row_shape, dtype=np.int64))
    self.f = zf.open(array.member)
    self.whole = None
    self.row = 0
    _header(self.f, self.where)
    if array.fortran:  # no row-major byte range: read it whole
      self.whole = np.lib.format.read_array(zf.open(array.member), allow_pickle=False)

  def seek(self, row: int) -> None:
    if self.whole is None:
      skip = row * self.row_items * self.dtype.itemsize
      while skip:  # forward reads: compressed members cannot seek cheaply
        got = len(self.f.read(min(skip, _CHUNK_BYTES)))
        if not got:
          raise ConvertError(f"{self.where}: the data ends early (truncated)")
        skip -= got
    self.row = row

  def read(self, k: int) -> np.ndarray:
    if self.whole is not None:
      block = self.whole[self.row:self.row + k]
    else:
      n = k * self.row_items * self.dtype.itemsize
      data = self.f.read(n)
      if len(data) != n:
        raise ConvertError(f"{self.where}: the data ends early (truncated)")
      block = np.frombuffer(data, dtype=self.dtype).reshape((k, *self.array.row_shape))
    self.row += k
    return np.ascontiguousarray(block.astype(self.little, copy=False))

  def close(self) -> None:
    self.f.close()
