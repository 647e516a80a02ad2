"""What one host reads, said once: `ReadSpec`, and the dataset's `Kind`.

`RemoteDataset` makes one from its arguments, and everything that asks the
servers for steps takes it instead of the dataset: both readers
(client/step_iterator.py, client/stream_iterator.py) on their skeleton
(client/iterator.py), explain and summary (client/remote_dataset.py), a
stream's fast-forward (client/stream_iterator.py) and summary
(client/stream_summary.py), the window (client/window.py), the meter
(client/stats.py) and the cursor (client/state.py). So every `pb.BatchRequest` the client sends is built
here (`request`), and whether a dataset is read by step or as a stream
(the wire's `DatasetInfo.stream`) is read here, once it is described
(`kind`). Below, the transport reads it once for itself, to route a
stream's chunks (`ConnectionPool._stream`, client/transport/pool.py): it
imports nothing of the client above it.
"""

from __future__ import annotations

import dataclasses
import enum

from grain_elevator.client.transport.options import RetryPolicy, Security, TransportOptions
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire
from grain_elevator.proto.errors import InternalError
from grain_elevator.proto.spec import DatasetInfo


class Kind(enum.Enum):
  """How a dataset's steps are found, so which reader reads it."""

  STEP = "step"  # any step in O(1) from its number: a 1:1 dataset or a mixture
  STREAM = "stream"  # from the position where it starts: a stream dataset


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadSpec:
  """Host `shard_index` of `shard_count`'s rows of `dataset`'s global batches
  of `global_batch_size`, from `targets`, with the options the trainer gave
  `RemoteDataset` (whose Args say what each means and its defaults); and,
  once the servers described the dataset (`described`), its `info`.

  Example (as `RemoteDataset.__iter__` uses it):
    (info,) = backend.describe(spec.dataset, spec.global_batch_size)
    spec = spec.described(info)
    spec.kind             # Kind.STEP or Kind.STREAM: which reader reads it
    spec.request(0, 4)    # the request for steps [0, 4) of this host
  """

  targets: tuple[str, ...]  # parsed (client/transport/targets.py)
  dataset: str
  global_batch_size: int  # G
  shard_index: int  # h
  shard_count: int  # H
  prefetch: int | None  # None: the window adapts (client/window.py)
  window_bytes: int
  transport: TransportOptions
  retry: RetryPolicy
  security: Security
  stats_log_s: float
  info: DatasetInfo | None = dataclasses.field(default=None, repr=False)

  def described(self, info: DatasetInfo) -> ReadSpec:
    """This spec, with the dataset as the servers describe it."""
    return dataclasses.replace(self, info=info)

  def require_info(self) -> DatasetInfo:
    """`info`; InternalError if the dataset was not described yet."""
    if self.info is None:
      raise InternalError(f"{self}: dataset {self.dataset!r} was not described yet")
    return self.info

  @property
  def kind(self) -> Kind:
    """Step or stream: where the client above the transport reads
    `DatasetInfo.stream`."""
    return Kind.STREAM if self.require_info().stream else Kind.STEP

  def request(self, start_step: int, num_steps: int, *, record_offset: int = 0,
              stream_state: str = "", compressed: bool = False,
              whole: bool = False, timed: bool = False,
              stream_shard: int = 0) -> pb.BatchRequest:
    """The request for steps [start_step, start_step + num_steps): this
    host's rows of them, or with `whole` the whole global batches (a
    summary counts them all). `compressed`: batches come back in the
    transport's compression (a fetch; skips and explains send none);
    `timed`: each says how long it takes to make (client/request_size.py);
    `stream_shard`: the sub-stream it reads, of a stream of several
    (stream_state is then that sub-stream's position)."""
    shards = self.require_info().stream_shards
    return pb.BatchRequest(
        dataset=self.dataset, global_batch_size=self.global_batch_size,
        shard_index=0 if whole else self.shard_index,
        shard_count=1 if whole else self.shard_count, start_step=start_step,
        num_steps=num_steps, config_fingerprint=self.require_info().config_fingerprint,
        record_offset=record_offset, stream_state=stream_state,
        compression=wire.COMPRESSIONS[self.transport.compression if compressed else "none"],
        report_production=timed, stream_shard=stream_shard,
        stream_shards=shards if shards > 1 else 0)

  def __str__(self) -> str:
    """How errors and logs name what is read: as the RemoteDataset it is."""
    return (f"RemoteDataset(targets={list(self.targets)}, dataset={self.dataset!r}, "
            f"G={self.global_batch_size}, h={self.shard_index}/{self.shard_count})")
