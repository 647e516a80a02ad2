"""A batch leaf kept as its rows, stacked by the socket instead of by a copy.

Stacking 32 records of 150 KiB into one array costs a worker a pass over
4.9 MB, and the kernel then copies the array again into the socket. A
`RowStack` keeps each row where the reader left it (typically a view of the
record's bytes) and hands `sendmsg` one buffer per row: the bytes on the wire
are exactly the stacked array's, and the server skips one copy of the batch
(BENCHMARKS.md). Whatever needs the array itself (embedded mode, compression,
gRPC's one-buffer messages) calls `np.asarray` on it.

The rows are held, never copied or written, so they must not change after
the batch is built: views of immutable record bytes, or arrays nothing else
writes to.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# Rows at least this big are worth a buffer of their own in `sendmsg`; smaller
# ones are cheaper to copy together than to pass one by one.
MIN_ROW_BYTES = 16 << 10


class RowStack:
  """`np.stack(rows)`, not yet stacked. Rows share one dtype and shape and
  are C-contiguous."""

  __slots__ = ("rows", "dtype", "shape")

  def __init__(self, rows: Sequence[np.ndarray]):
    if not rows:
      raise ValueError("a RowStack needs at least one row")
    first = rows[0]
    for i, row in enumerate(rows):
      if not isinstance(row, np.ndarray):
        raise TypeError(f"RowStack row {i} is {type(row).__name__}, not a numpy array")
      if row.dtype != first.dtype or row.shape != first.shape:
        raise ValueError(f"RowStack row {i} is {row.dtype}{list(row.shape)}, row 0 is "
                         f"{first.dtype}{list(first.shape)}")
      if not row.flags.c_contiguous:
        raise ValueError(f"RowStack row {i} is not C-contiguous")
    self.rows = list(rows)
    self.dtype: np.dtype = first.dtype
    self.shape: tuple[int, ...] = (len(rows), *first.shape)

  def __len__(self) -> int:
    return len(self.rows)

  @property
  def nbytes(self) -> int:
    return len(self.rows) * self.rows[0].nbytes

  def buffers(self) -> list[memoryview]:
    """Each row's bytes, in order: together, the stacked array's buffer."""
    if not self.rows[0].nbytes:
      return [memoryview(b"")] * len(self.rows)
    return [memoryview(r).cast("B") for r in self.rows]

  def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
    del copy  # a new array either way
    out = np.empty(self.shape, self.dtype)
    for i, row in enumerate(self.rows):
      out[i] = row
    return out if dtype is None else out.astype(dtype, copy=False)

  def tobytes(self) -> bytes:
    return b"".join(self.buffers())

  def __repr__(self) -> str:
    return f"RowStack({self.dtype}{list(self.shape)})"

