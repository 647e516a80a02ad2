"""Batches on the wire: the one encoder and the one decoder of `Batch`.

Tensor bytes travel as raw little-endian C-order buffers in `Tensor.data`
and come back out with `np.frombuffer` (no per-element protobuf fields).
Both functions skip protobuf object construction, which would copy each
tensor two more times: the server writes a Batch's wire bytes as a list of
buffers (tensor data not copied; a socket gathers them), and the client reads
the tensors as views of the received bytes. They produce and accept exactly
the proto3 encoding of `Batch`, so any language's generated stubs
interoperate (tests/proto/test_wire.py checks this against protobuf's own).

The decoder trusts nothing it reads: given the leaves a client asked for
(proto/spec.py `ElementSpec.batch_leaves`), it checks each Tensor's dtype and
shape against them before reading its data, and decompresses a zstd frame
into at most the bytes that dtype and shape hold. A peer's bug or lie is a
`BadBatchError`, never an allocation the spec does not allow.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto import varint
from grain_elevator.proto.dtypes import dtype_from_str, dtype_to_str
from grain_elevator.proto.rows import RowStack

if TYPE_CHECKING:
  from grain_elevator.proto.spec import LeafSpec


class BadBatchError(ValueError):
  """A Batch message that is malformed or not what was asked for (the
  element spec): the sender's fault."""


def _big_endian(dtype: np.dtype) -> bool:
  return dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian)


def _little_endian(a: np.ndarray) -> np.ndarray:
  if _big_endian(a.dtype):
    a = a.astype(a.dtype.newbyteorder("<"))
  return np.ascontiguousarray(a)


COMPRESSION_NONE = pb.COMPRESSION_NONE
COMPRESSION_ZSTD = pb.COMPRESSION_ZSTD
# What a client names (TransportOptions.compression) -> its code on the wire.
COMPRESSIONS = {"none": COMPRESSION_NONE, "zstd": COMPRESSION_ZSTD}
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
  if compression not in COMPRESSIONS.values():
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


def _tensor_head(dtype: np.dtype, shape: Sequence[int], size: int, codec: int) -> bytes:
  """A Tensor's fields before its data: dtype, packed shape, and the data's
  tag and length (none when `size` is 0)."""
  name = dtype_to_str(dtype).encode()
  head = [b"\x0a", varint.encode(len(name)), name]
  if len(shape):
    packed = b"".join(varint.encode(d) for d in shape)
    head += [b"\x12", varint.encode(len(packed)), packed]
  if size:
    head += [b"\x1a", varint.encode(size)]
  return b"".join(head)


@functools.lru_cache(maxsize=16)
def step_field(step: int) -> bytes:
  """A Batch's step field (first); proto3 leaves out a 0."""
  return b"\x08" + varint.encode(step) if step else b""


def encode_batch_parts(step: int, leaves: Sequence[np.ndarray | RowStack],
                       compression: int = COMPRESSION_NONE,
                       next_stream_state: str = "") -> list[Any]:
  """The proto3 encoding of a Batch as a list of buffers, tensor data not
  copied (unless compressed): a socket can send them with one `sendmsg`.
  A RowStack leaf contributes one buffer per row (proto/rows.py).
  `next_stream_state`: a stream dataset's position after this step."""
  parts: list[Any] = [step_field(step)]
  for a in leaves:
    dt, data, size, codec = _tensor_data(a, compression)
    head = _tensor_head(dt, a.shape, size, codec)
    tail = b"\x20" + varint.encode(codec) if codec else b""
    parts += [b"\x12", varint.encode(len(head) + size + len(tail)), head, *data]
    if tail:
      parts.append(tail)
  if next_stream_state:
    parts.append(stream_state_field(next_stream_state))
  return parts


def stream_state_field(state: str) -> bytes:
  """A Batch's next_stream_state field, as the encoder writes it (last)."""
  data = state.encode()
  return b"\x1a" + varint.encode(len(data)) + data


def production_field(us: int) -> bytes:
  """A Batch's production_us field, as the server writes it (after the
  stream position); proto3 leaves out a 0."""
  return b"\x20" + varint.encode(us) if us > 0 else b""


def encode_batch_bytes(step: int, leaves: Sequence[np.ndarray | RowStack],
                       compression: int = COMPRESSION_NONE,
                       next_stream_state: str = "") -> bytes:
  """The serialized Batch in one buffer (one copy of the tensor data)."""
  return b"".join(encode_batch_parts(step, leaves, compression, next_stream_state))


def _decompress(frame: memoryview, size: int) -> bytes:
  """A zstd frame's content, which must be exactly `size` bytes. A frame
  declaring another size is refused before anything is allocated; one that
  does not declare it cannot grow past `size`."""
  zstd = _zstd()
  try:
    declared = zstd.frame_content_size(frame)  # -1: not declared
    if declared not in (-1, size):
      raise BadBatchError(f"zstd frame declares {declared} bytes for {size} (its dtype "
                          "and shape)")
    raw = zstd.ZstdDecompressor().decompress(frame, max_output_size=max(size, 1))
  except zstd.ZstdError as e:
    raise BadBatchError(f"zstd frame does not decompress to {size} bytes: {e}") from None
  if len(raw) != size:
    raise BadBatchError(f"zstd frame holds {len(raw)} bytes for {size} (its dtype "
                        "and shape)")
  return raw


def _decode_tensor(data: Any, buf: memoryview, pos: int, end: int,
                   want: LeafSpec | None) -> np.ndarray:
  dtype, shape, offset, nbytes, codec = "", [], pos, 0, COMPRESSION_NONE
  while pos < end:
    key, pos = varint.decode(buf, pos)
    field, wire_type = key >> 3, key & 7
    if field == 1 and wire_type == varint.LEN:
      n, pos = varint.decode(buf, pos)
      dtype = bytes(buf[pos:pos + n]).decode()
      pos += n
    elif field == 2 and wire_type == varint.LEN:  # packed
      n, pos = varint.decode(buf, pos)
      stop = pos + n
      while pos < stop:
        d, pos = varint.decode(buf, pos)
        shape.append(d)
    elif field == 2 and wire_type == varint.VARINT:  # unpacked
      d, pos = varint.decode(buf, pos)
      shape.append(d)
    elif field == 3 and wire_type == varint.LEN:
      nbytes, pos = varint.decode(buf, pos)
      offset = pos
      pos += nbytes
    elif field == 4 and wire_type == varint.VARINT:
      codec, pos = varint.decode(buf, pos)
    else:
      pos = varint.skip(buf, pos, wire_type)
  if pos != end:
    raise BadBatchError("Tensor overruns its Batch message")
  try:
    dt = dtype_from_str(dtype)
  except ValueError as e:
    raise BadBatchError(f"dtype: {e}") from None
  if want is not None and (dt != want.dtype or tuple(shape) != want.shape):
    raise BadBatchError(f"{dtype_to_str(dt)}{shape} where the element spec says "
                        f"{dtype_to_str(want.dtype)}{list(want.shape)}")
  if dt.hasobject or not dt.itemsize:
    raise BadBatchError(f"dtype {dtype!r} has no fixed-size bytes")
  count = math.prod(shape)
  size = count * dt.itemsize
  if codec == COMPRESSION_ZSTD:
    raw = _decompress(buf[offset:offset + nbytes], size)
    return np.frombuffer(raw, dtype=dt).reshape(shape)
  if codec != COMPRESSION_NONE:
    raise BadBatchError(f"Tensor has unknown compression {codec}")
  if nbytes != size:
    raise BadBatchError(f"{nbytes} bytes of data for {size} (its dtype and shape)")
  return np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape)


def decode_batch_bytes(data: Any, expect: Sequence[LeafSpec] | None = None
                       ) -> tuple[int, list[np.ndarray]]:
  """(step, leaves) of a serialized Batch: `decode_batch_message` without
  the stream position."""
  step, leaves, _, _ = decode_batch_message(data, expect)
  return step, leaves


def decode_batch_message(data: Any, expect: Sequence[LeafSpec] | None = None
                         ) -> tuple[int, list[np.ndarray], str, int]:
  """(step, leaves, next_stream_state, production_us) of a serialized Batch
  (bytes or any byte buffer); raw leaves are views of `data`, compressed
  ones own their bytes.

  `expect`: the leaves the batch must hold, in order (a client's
  `ElementSpec.batch_leaves`); each Tensor's dtype and shape are checked
  before its data is read. Raises BadBatchError, naming the leaf, for a
  message that is malformed or breaks `expect`.
  """
  buf = memoryview(data)
  pos, step, leaves, state, production_us = 0, 0, [], "", 0
  try:
    while pos < len(buf):
      key, pos = varint.decode(buf, pos)
      field, wire_type = key >> 3, key & 7
      if field == 1 and wire_type == varint.VARINT:
        step, pos = varint.decode(buf, pos)
        if step >= 1 << 63:
          step -= 1 << 64
      elif field == 2 and wire_type == varint.LEN:
        n, pos = varint.decode(buf, pos)
        if expect is not None and len(leaves) == len(expect):
          raise BadBatchError(f"more leaves than the {len(expect)} of the element spec")
        want = expect[len(leaves)] if expect is not None else None
        try:
          leaves.append(_decode_tensor(data, buf, pos, pos + n, want))
        except ValueError as e:
          where = f"leaf {len(leaves)}" + (f" ({want.path!r})" if want else "")
          raise BadBatchError(f"{where}: {e}") from None
        pos += n
      elif field == 3 and wire_type == varint.LEN:
        n, pos = varint.decode(buf, pos)
        if pos + n > len(buf):
          raise BadBatchError("next_stream_state overruns its Batch message")
        try:
          state = bytes(buf[pos:pos + n]).decode()
        except UnicodeDecodeError as e:
          raise BadBatchError(f"next_stream_state is not UTF-8: {e}") from None
        pos += n
      elif field == 4 and wire_type == varint.VARINT:
        production_us, pos = varint.decode(buf, pos)
      else:
        pos = varint.skip(buf, pos, wire_type)
  except BadBatchError:
    raise
  except ValueError as e:  # a truncated varint or field
    raise BadBatchError(f"malformed Batch message: {e}") from None
  if pos != len(buf):
    raise BadBatchError("truncated Batch message")
  if expect is not None and len(leaves) != len(expect):
    raise BadBatchError(f"{len(leaves)} leaves where the element spec has {len(expect)}")
  return step, leaves, state, production_us


def decode_batch(data: Any, structure: tree.Structure) -> tuple[int, Any]:
  """(step, element pytree) of a serialized Batch, by the dataset's structure."""
  step, leaves = decode_batch_bytes(data)
  return step, tree.unflatten(structure, leaves)


class BatchLayout:
  """The uncompressed Batch of a step whose leaves are `leaves`, byte for
  byte as `encode_batch_parts` writes it: the dtype and shape of each leaf
  (the element spec's) fix every byte that is not tensor data, but for the
  step's varint at the front, which a receiver knows too. So a receiver can
  put each leaf's data where it wants it and check all the rest with one
  comparison against `gaps`, parsing nothing. Any other encoding of the same
  Batch (compressed, fields in another order, a peer's lie) fails that
  comparison and goes to `decode_batch_message`, which reads any valid
  Batch and names the fault of any other."""

  def __init__(self, leaves: Sequence[LeafSpec]):
    self.leaves = tuple(leaves)
    self.sizes = tuple(leaf.nbytes for leaf in self.leaves)
    heads = []
    for leaf, size in zip(self.leaves, self.sizes):
      head = _tensor_head(leaf.dtype, leaf.shape, size, COMPRESSION_NONE)
      heads.append(b"\x12" + varint.encode(len(head) + size) + head)
    self.heads = tuple(heads)  # the bytes before each leaf's data (the step's field aside)
    self.joined_heads = b"".join(heads)
    self._fixed = len(self.joined_heads) + sum(self.sizes)

  def size(self, step: int) -> int:
    """The message's length, with no stream position after it."""
    return len(step_field(step)) + self._fixed

  def gaps(self, step: int) -> list[bytes]:
    """The bytes before each leaf's data, in order (the step's field goes
    before the first leaf's); one item when there are no leaves."""
    if not self.heads:
      return [step_field(step)]
    return [step_field(step) + self.heads[0], *self.heads[1:]]

  def decode(self, data: Any, step: int) -> tuple[list[np.ndarray], str, int] | None:
    """(leaves, next_stream_state, production_us) of `data` (bytes or a byte
    buffer) when it is exactly this layout's encoding of `step` (a stream
    position and a production time may follow); else None. Leaves are
    views of `data`."""
    buf = memoryview(data)
    pos, leaves = 0, []
    for i, gap in enumerate(self.gaps(step)):
      end = pos + len(gap)
      if buf[pos:end] != gap:
        return None
      pos = end
      if i < len(self.leaves):
        leaf, size = self.leaves[i], self.sizes[i]
        if pos + size > len(buf):
          return None
        leaves.append(np.ndarray(leaf.shape, leaf.dtype, buffer=buf, offset=pos))
        pos += size
    tail = canonical_tail(buf[pos:])
    return None if tail is None else (leaves, *tail)


def canonical_tail(tail: Any) -> tuple[str, int] | None:
  """(next_stream_state, production_us) from the bytes after a Batch's last
  leaf, when they are exactly what `stream_state_field` then
  `production_field` write, each optional (nothing at all: ("", 0)); else
  None."""
  tail = memoryview(tail)
  state, pos = "", 0
  if len(tail) and tail[0] == 0x1a:
    try:
      n, pos = varint.decode(tail, 1)
    except ValueError:
      return None
    if pos + n > len(tail):
      return None
    try:
      state = bytes(tail[pos:pos + n]).decode()
    except UnicodeDecodeError:
      return None
    pos += n
  production_us = 0
  if pos < len(tail):
    if tail[pos] != 0x20:
      return None
    try:
      production_us, pos = varint.decode(tail, pos + 1)
    except ValueError:
      return None
  return (state, production_us) if pos == len(tail) else None


@functools.lru_cache(maxsize=64)
def layout_of(leaves: tuple[LeafSpec, ...]) -> BatchLayout:
  """The BatchLayout of steps with these leaves (a dataset's few geometries)."""
  return BatchLayout(leaves)


def max_batch_bytes(raw_bytes: int, num_leaves: int) -> int:
  """The most a serialized Batch holding `raw_bytes` of tensor data in
  `num_leaves` tensors can take: the data (zstd can grow incompressible data
  by up to 1/256 and a frame header), plus each tensor's dtype, shape and
  tags. A receiver refuses a longer message before allocating it."""
  return raw_bytes + raw_bytes // 128 + 512 * (num_leaves + 1)
