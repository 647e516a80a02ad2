"""Encoding between numpy batches and the v1 messages.

Bulk tensor bytes travel as raw little-endian C-order buffers in
`Tensor.data` and come back out with `np.frombuffer` (no per-element
protobuf fields), so a message stays valid for any language's stubs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree


def dtype_to_str(dtype: np.dtype) -> str:
  """A portable dtype name: "float32", "uint8"; numpy's code ("|S64") where a
  name would not round-trip (fixed-size bytes and strings)."""
  try:
    if np.dtype(dtype.name) == dtype:
      return dtype.name
  except TypeError:
    pass
  return dtype.newbyteorder("<").str if dtype.byteorder not in "|" else dtype.str


def dtype_from_str(text: str) -> np.dtype:
  return np.dtype(text).newbyteorder("<")


def _little_endian(a: np.ndarray) -> np.ndarray:
  if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
    a = a.astype(a.dtype.newbyteorder("<"))
  return np.ascontiguousarray(a)


def encode_batch(step: int, leaves: Sequence[np.ndarray]) -> pb.Batch:
  tensors = []
  for a in leaves:
    a = _little_endian(a)
    tensors.append(pb.Tensor(dtype=dtype_to_str(a.dtype), shape=a.shape, data=a.tobytes()))
  return pb.Batch(step=step, leaves=tensors)


def decode_leaves(batch: pb.Batch) -> list[np.ndarray]:
  """The batch's leaves as read-only arrays over the message's bytes."""
  return [
      np.frombuffer(t.data, dtype=dtype_from_str(t.dtype)).reshape(t.shape)
      for t in batch.leaves
  ]


def decode_batch(batch: pb.Batch, structure: tree.Structure) -> Any:
  return tree.unflatten(structure, decode_leaves(batch))
