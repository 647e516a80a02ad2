"""Encoding between numpy batches and the v1 messages.

Bulk tensor bytes travel as raw little-endian C-order buffers in
`Tensor.data` and come back out with `np.frombuffer` (no per-element
protobuf fields), so a message stays valid for any language's stubs.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto.rows import RowStack


@functools.lru_cache(maxsize=256)
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


def _big_endian(dtype: np.dtype) -> bool:
  return dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian)


def _little_endian(a: np.ndarray) -> np.ndarray:
  if _big_endian(a.dtype):
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
  out = []
  for t in batch.leaves:
    data = t.data
    if t.compression == COMPRESSION_ZSTD:
      data = _zstd().ZstdDecompressor().decompress(data)
    elif t.compression != COMPRESSION_NONE:
      raise ValueError(f"Tensor has unknown compression {t.compression}")
    out.append(np.frombuffer(data, dtype=dtype_from_str(t.dtype)).reshape(t.shape))
  return out


def decode_batch(batch: pb.Batch, structure: tree.Structure) -> Any:
  return tree.unflatten(structure, decode_leaves(batch))


# -- Hand-rolled Batch encoding --------------------------------------------
# The hot path skips protobuf object construction: the server writes a
# Batch's wire bytes with one copy of each tensor, and the client reads the
# tensors as views of the received bytes. Both produce and accept exactly the
# proto3 encoding of `Batch`, so any language's generated stubs interoperate
# (tests/test_proto.py checks byte equality with SerializeToString).

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
  if value < 0:
    value += 1 << 64  # int64 two's complement, as protobuf encodes it
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    if pos >= len(buf):
      raise ValueError("truncated varint in Batch message")
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise ValueError("varint too long in Batch message")


COMPRESSION_NONE = pb.COMPRESSION_NONE
COMPRESSION_ZSTD = pb.COMPRESSION_ZSTD
# Below this a tensor is sent raw even when compression is asked for: ids and
# labels would gain a few bytes and cost a codec call each.
MIN_COMPRESSED_BYTES = 4096
ZSTD_LEVEL = 1  # the fast end: compression is for slow links, not archives


def _zstd():
  try:
    import zstandard  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - a core dependency
    raise RuntimeError("compression needs the 'zstandard' package") from e
  return zstandard


def _tensor_data(a: np.ndarray | RowStack, compression: int
                 ) -> tuple[np.dtype, list[Any], int, int]:
  """(dtype as sent, buffers, their total size, codec) of one leaf's Tensor."""
  if compression not in (COMPRESSION_NONE, COMPRESSION_ZSTD):
    raise ValueError(f"unknown compression {compression}")
  if isinstance(a, RowStack):
    if compression == COMPRESSION_NONE and not _big_endian(a.dtype):
      return a.dtype, a.buffers(), a.nbytes, COMPRESSION_NONE  # gathered by the socket
    a = np.asarray(a)
  a = _little_endian(a)
  if not a.nbytes:
    return a.dtype, [], 0, COMPRESSION_NONE
  data: Any = memoryview(a).cast("B")
  if compression == COMPRESSION_ZSTD and a.nbytes >= MIN_COMPRESSED_BYTES:
    data = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    return a.dtype, [data], len(data), COMPRESSION_ZSTD
  return a.dtype, [data], len(data), COMPRESSION_NONE


def encode_batch_parts(step: int, leaves: Sequence[np.ndarray | RowStack],
                       compression: int = COMPRESSION_NONE) -> list[Any]:
  """The proto3 encoding of a Batch as a list of buffers, tensor data not
  copied (unless compressed): a socket can send them with one `sendmsg`.
  A RowStack leaf contributes one buffer per row (proto/rows.py)."""
  parts: list[Any] = []
  if step:
    parts += [b"\x08", _varint(step)]
  for a in leaves:
    dt, data, size, codec = _tensor_data(a, compression)
    dtype = dtype_to_str(dt).encode()
    head = [b"\x0a", _varint(len(dtype)), dtype]
    if a.shape:
      packed = b"".join(_varint(d) for d in a.shape)
      head += [b"\x12", _varint(len(packed)), packed]
    if size:
      head += [b"\x1a", _varint(size)]
    tail = b"\x20" + _varint(codec) if codec else b""
    head_bytes = b"".join(head)
    parts += [b"\x12", _varint(len(head_bytes) + size + len(tail)), head_bytes, *data]
    if tail:
      parts.append(tail)
  return parts


def encode_batch_bytes(step: int, leaves: Sequence[np.ndarray | RowStack],
                       compression: int = COMPRESSION_NONE) -> bytes:
  """`encode_batch(step, leaves).SerializeToString()`, with one data copy."""
  return b"".join(encode_batch_parts(step, leaves, compression))


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
  if wire_type == _WIRE_VARINT:
    return _read_varint(buf, pos)[1]
  if wire_type == _WIRE_I64:
    return pos + 8
  if wire_type == _WIRE_I32:
    return pos + 4
  if wire_type == _WIRE_LEN:
    n, pos = _read_varint(buf, pos)
    return pos + n
  raise ValueError(f"unsupported wire type {wire_type} in Batch message")


def _decode_tensor(data: Any, buf: memoryview, pos: int, end: int) -> np.ndarray:
  dtype, shape, offset, nbytes, codec = "", [], pos, 0, COMPRESSION_NONE
  while pos < end:
    key, pos = _read_varint(buf, pos)
    field, wire_type = key >> 3, key & 7
    if field == 1 and wire_type == _WIRE_LEN:
      n, pos = _read_varint(buf, pos)
      dtype = bytes(buf[pos:pos + n]).decode()
      pos += n
    elif field == 2 and wire_type == _WIRE_LEN:  # packed
      n, pos = _read_varint(buf, pos)
      stop = pos + n
      while pos < stop:
        d, pos = _read_varint(buf, pos)
        shape.append(d)
    elif field == 2 and wire_type == _WIRE_VARINT:  # unpacked
      d, pos = _read_varint(buf, pos)
      shape.append(d)
    elif field == 3 and wire_type == _WIRE_LEN:
      nbytes, pos = _read_varint(buf, pos)
      offset = pos
      pos += nbytes
    elif field == 4 and wire_type == _WIRE_VARINT:
      codec, pos = _read_varint(buf, pos)
    else:
      pos = _skip(buf, pos, wire_type)
  if pos != end:
    raise ValueError("Tensor overruns its Batch message")
  dt = dtype_from_str(dtype)
  if codec == COMPRESSION_ZSTD:
    raw = _zstd().ZstdDecompressor().decompress(buf[offset:offset + nbytes])
    return np.frombuffer(raw, dtype=dt).reshape(shape)
  if codec != COMPRESSION_NONE:
    raise ValueError(f"Tensor has unknown compression {codec}")
  return np.frombuffer(data, dtype=dt, count=nbytes // dt.itemsize,
                       offset=offset).reshape(shape)


def decode_batch_bytes(data: Any) -> tuple[int, list[np.ndarray]]:
  """(step, leaves) of a serialized Batch (bytes or any byte buffer); raw
  leaves are views of `data`, compressed ones own their bytes."""
  buf = memoryview(data)
  pos, step, leaves = 0, 0, []
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wire_type = key >> 3, key & 7
    if field == 1 and wire_type == _WIRE_VARINT:
      step, pos = _read_varint(buf, pos)
      if step >= 1 << 63:
        step -= 1 << 64
    elif field == 2 and wire_type == _WIRE_LEN:
      n, pos = _read_varint(buf, pos)
      leaves.append(_decode_tensor(data, buf, pos, pos + n))
      pos += n
    else:
      pos = _skip(buf, pos, wire_type)
  if pos != len(buf):
    raise ValueError("truncated Batch message")
  return step, leaves
