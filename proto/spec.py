"""What a client learns about a dataset: its element spec and stream size.

Plain data shared by the server (which computes it), the wire (which carries
it in Describe) and the client (which checks cursors against it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import dtypes
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto import wire


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  path: str
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    """Bytes of one value of this shape (exact: Python ints, no overflow)."""
    return self.dtype.itemsize * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ElementSpec:
  structure: tree.Structure
  leaves: tuple[LeafSpec, ...]

  @property
  def record_bytes(self) -> int:
    return sum(l.nbytes for l in self.leaves)

  def batch_leaves(self, rows: int) -> tuple[LeafSpec, ...]:
    """The leaves of a batch of `rows` records, as a client checks each
    step it receives (proto/wire.py `decode_batch_bytes`)."""
    return tuple(LeafSpec(l.path, l.dtype, (rows, *l.shape)) for l in self.leaves)

  def max_batch_bytes(self, rows: int) -> int:
    """The longest serialized Batch of `rows` records can be: a receiver
    refuses a longer message before allocating it."""
    return wire.max_batch_bytes(rows * self.record_bytes, len(self.leaves))

  @classmethod
  def of(cls, record: Any) -> "ElementSpec":
    leaves, structure, paths = tree.flatten(record)
    arrays = [tree.as_array(l) for l in leaves]
    return cls(structure, tuple(
        LeafSpec(p, a.dtype, a.shape) for p, a in zip(paths, arrays)))

  def to_proto(self) -> pb.ElementSpec:
    return pb.ElementSpec(
        structure=tree.structure_to_json(self.structure),
        leaves=[pb.LeafSpec(path=l.path, dtype=dtypes.dtype_to_str(l.dtype), shape=l.shape)
                for l in self.leaves])

  @classmethod
  def from_proto(cls, msg: pb.ElementSpec) -> "ElementSpec":
    return cls(tree.structure_from_json(msg.structure), tuple(
        LeafSpec(l.path, dtypes.dtype_from_str(l.dtype), tuple(l.shape)) for l in msg.leaves))


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a client needs to know about a dataset (the Describe answer)."""

  name: str
  num_records: int  # per epoch
  num_epochs: int  # 0 = forever
  shuffle: bool
  seed: int
  config_fingerprint: str
  element_spec: ElementSpec
  stream_length: int  # records in the whole stream; FOREVER_LENGTH if forever
  drop_remainder: bool = True  # False: evaluation mode (contract.MASK_KEY)
  # A mixture's schedule (server/data/mixture.py): segment first steps, and what
  # a cursor inside each segment names in place of config_fingerprint.
  segment_steps: tuple[int, ...] = ()
  segment_fingerprints: tuple[str, ...] = ()
  # A stream dataset (server/data/streams/stream.py): batches are the k-th
  # of its Grain pipeline, found from a stream position, not from step
  # arithmetic; its steps are not known ahead (total_steps is None) and
  # num_records counts its source's records per epoch.
  stream: bool = False
  stream_start: str = ""  # a stream dataset's first position (JSON), where step 0 starts
  # A stream of N sub-streams (contract.sub_stream_rows): N > 1, and each
  # one's first position (stream_start is the first's).
  stream_shards: int = 1
  stream_starts: tuple[str, ...] = ()

  @property
  def starts(self) -> tuple[str, ...]:
    """Each sub-stream's first position: one for a stream of one."""
    return self.stream_starts if self.stream_shards > 1 else (self.stream_start,)

  def cursor_fingerprint(self, step: int) -> str:
    """What a cursor at `step` names: the whole config's fingerprint, or for a
    mixture only what decided the steps before it."""
    if not self.segment_steps:
      return self.config_fingerprint
    i = max([0] + [k for k, s in enumerate(self.segment_steps) if s < step])
    return self.segment_fingerprints[i]

  @property
  def repeats_forever(self) -> bool:
    return self.num_epochs == 0

  def steps_per_epoch(self, global_batch_size: int) -> int:
    if self.stream:
      return 0
    return contract.steps_per_epoch(self.num_records, global_batch_size)

  def total_steps(self, global_batch_size: int, record_offset: int = 0) -> int | None:
    """Steps in the stream from `record_offset` on, or None if it repeats
    forever or is a stream dataset (whose end shows only when it comes)."""
    if self.repeats_forever or self.stream:
      return None
    return contract.total_steps(self.stream_length, global_batch_size, record_offset,
                                self.drop_remainder)

  def to_proto(self, global_batch_size: int = 0) -> pb.DatasetInfo:
    msg = pb.DatasetInfo(
        name=self.name, num_records=self.num_records, num_epochs=self.num_epochs,
        shuffle=self.shuffle, seed=self.seed,
        config_fingerprint=self.config_fingerprint,
        element_spec=self.element_spec.to_proto(),
        global_batch_size=global_batch_size, pad_remainder=not self.drop_remainder,
        segment_steps=self.segment_steps, segment_fingerprints=self.segment_fingerprints,
        stream=self.stream, stream_start=self.stream_start,
        stream_shards=self.stream_shards if self.stream_shards > 1 else 0,
        stream_starts=self.stream_starts if self.stream_shards > 1 else ())
    if global_batch_size > 0 and not self.stream:
      msg.steps_per_epoch = self.steps_per_epoch(global_batch_size)
      total = self.total_steps(global_batch_size)
      msg.total_steps = -1 if total is None else total
    return msg

  @classmethod
  def from_proto(cls, msg: pb.DatasetInfo) -> "DatasetInfo":
    spec = ElementSpec.from_proto(msg.element_spec)
    length = (msg.num_records * msg.num_epochs if msg.num_epochs
              else contract.FOREVER_LENGTH)
    return cls(name=msg.name, num_records=msg.num_records,
               num_epochs=msg.num_epochs, shuffle=msg.shuffle, seed=msg.seed,
               config_fingerprint=msg.config_fingerprint, element_spec=spec,
               stream_length=length, drop_remainder=not msg.pad_remainder,
               segment_steps=tuple(msg.segment_steps), stream=msg.stream,
               stream_start=msg.stream_start, stream_shards=max(1, msg.stream_shards),
               stream_starts=tuple(msg.stream_starts),
               segment_fingerprints=tuple(msg.segment_fingerprints))
