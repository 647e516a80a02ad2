"""Protobuf base-128 varints, for the hand-written encodings.

Used where protobuf objects would cost more than the work: batch messages on
the hot path (proto/wire.py), the footers of ArrayRecord shards
(server/data/shards/) and tf.train.Example records (pipelines/tf_example.py).
A truncated, over-long or over-64-bit varint is a ValueError. It imports
nothing of ours, so the converter's Beam environment (no gRPC stubs) uses it
too.
"""

from __future__ import annotations

from typing import Iterator


def encode(value: int) -> bytes:
  """`value` as a varint; negative int64s as protobuf writes them (10 bytes)."""
  if value < 0:
    value += 1 << 64
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def decode(buf: bytes | memoryview, pos: int, end: int | None = None) -> tuple[int, int]:
  """(value, position after it) of the varint at `pos`, which must end
  before `end` (the buffer's length by default)."""
  end = len(buf) if end is None else end
  result = shift = 0
  while True:
    if pos >= end:
      raise ValueError("a varint runs past the end of its message")
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      if result >> 64:
        raise ValueError("a varint over 64 bits")
      return result, pos
    shift += 7
    if shift > 63:
      raise ValueError("a varint longer than 10 bytes")


VARINT, I64, LEN, I32 = 0, 1, 2, 5  # protobuf wire types


def skip(buf: bytes | memoryview, pos: int, wire_type: int) -> int:
  """The position after a field's value of `wire_type` that starts at `pos`."""
  if wire_type == VARINT:
    return decode(buf, pos)[1]
  if wire_type == I64:
    end = pos + 8
  elif wire_type == I32:
    end = pos + 4
  elif wire_type == LEN:
    n, pos = decode(buf, pos)
    end = pos + n
  else:
    raise ValueError(f"unsupported wire type {wire_type}")
  if end > len(buf):
    raise ValueError("field overruns its message")
  return end


def fields(message: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
  """(field number, wire type, value) of each field: ints for varints,
  views for length-delimited fields; other wire types are skipped."""
  buf = memoryview(message)
  pos = 0
  while pos < len(buf):
    key, pos = decode(buf, pos)
    number, wire_type = key >> 3, key & 7
    if wire_type == VARINT:
      value, pos = decode(buf, pos)
      yield number, wire_type, value
    elif wire_type == LEN:
      n, start = decode(buf, pos)
      pos = start + n
      if pos > len(buf):
        raise ValueError("field overruns its message")
      yield number, wire_type, buf[start:pos]
    else:
      pos = skip(buf, pos, wire_type)
