"""A step dataset: one that answers for any step, found in O(1).

A registered 1:1 dataset (elevator_dataset.py's `ElevatorDataset`) and a
mixture of them (mixture.py's `MixtureDataset`) both are one; the request
path sees nothing else of either. Its sibling is a stream dataset
(streams/stream.py's `StreamDataset`), which continues from a position
instead. The registry holds one of the two (registry/factory.py's `Dataset`), and
the request path serves each by its shape (server/serving/step_shape.py,
stream_shape.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from grain_elevator.proto.rows import RowStack
from grain_elevator.proto.spec import DatasetInfo


class StepDataset(Protocol):
  """A dataset the server offers by name, whose every step is found from
  the contract's arithmetic (proto/contract.py)."""

  info: DatasetInfo  # what Describe says of it: records, epochs, element spec, fingerprint

  def check_batch_size(self, global_batch_size: int) -> None:
    """Raises InvalidRequestError if no request of this G can be served
    (beyond the contract's own checks)."""

  def host_batch_leaves(self, step: int, global_batch_size: int, shard_index: int,
                        shard_count: int, *, record_offset: int = 0,
                        stack: bool = True) -> list[np.ndarray | RowStack]:
    """Host `shard_index` of `shard_count`'s rows of global batch `step`
    (counted from `record_offset`), one leaf each; `stack=False` may leave
    big rows as RowStacks for the socket to gather."""

  def read_needs(self, step: int, global_batch_size: int, shard_index: int,
                 shard_count: int, record_offset: int = 0) -> list[Any] | None:
    """What producing host h's rows of `step` reads from buckets: per
    object, its chunks' extents, planned ahead by server/serving/read_plan.py;
    None when nothing is read from a bucket."""
