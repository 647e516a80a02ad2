"""Every call into Grain's private API, in one place.

grain-elevator computes what Grain's own pipeline would give, record for
record, and a few of the functions that define it are private in Grain
(names with a leading underscore, or under `grain._src`). They are wrapped
here, named for what they mean to us, so that a Grain release that moves
one breaks one module, and CI tests the contract-critical paths (shuffle,
mix, checkpoint) on the lowest and the highest Grain release pyproject.toml
admits (`make test-grain-range`).

(array_record's ArrayRecordDataSource, which Grain re-exports, is extended
in record_source.py through its own internals: its read instructions,
readers and lock. That is array_record's API, versioned apart.)
"""

from __future__ import annotations

from typing import Any, Sequence

import grain
from array_record.python import array_record_data_source
from grain._src.python.dataset.transformations import mix as _mix


def mix_pick(record: int, proportions: Sequence[int]) -> tuple[int, int]:
  """(component, index within it) of record `record` of Grain's
  `MapDataset.mix` with these integer proportions: its periodic selection."""
  return _mix._dataset_and_key_of_next_element(record, proportions)  # pylint: disable=protected-access


def mix_proportions(weights: Sequence[float]) -> list[int]:
  """The integer proportions `MapDataset.mix` derives from float weights."""
  return _mix._float_to_int_proportions(list(weights))  # pylint: disable=protected-access


def getitems(ds: grain.MapDataset, positions: Sequence[int]) -> list[Any]:
  """Records at `positions` of `ds` in one call: Grain's batched read, which
  reaches a source's own batched read (record_source.py) instead of one
  ~60 µs call per record."""
  return ds._getitems(list(positions))  # pylint: disable=protected-access


def without_read_metrics(ds: grain.MapDataset) -> grain.MapDataset:
  """`ds` (a source node) without Grain's per-record read telemetry, which
  costs ~14 µs a record (measured on the small workload's records); the
  server reports its own metrics. A no-op on a Grain that has none."""
  ds._record_metrics = False  # pylint: disable=protected-access
  return ds


def array_record_reader(path: str, options: str) -> Any:
  """ArrayRecord's reader of one shard, as ArrayRecordDataSource opens it."""
  return array_record_data_source._create_reader(path, options)  # pylint: disable=protected-access


def state_from_json(state: Any) -> Any:
  """A Grain iterator state that went through JSON, as its iterator expects
  it back. JSON has no tuples, and ConcatThenSplitIterDataset compares its
  remainder slices with the tuple (-1, -1) ("no remainder"): read back as a
  list, that slice would be taken as a real one and its elements cut wrong
  (Grain's issue #1178 was this kind). Its slices become tuples again."""
  if isinstance(state, dict):
    out = {}
    for key, value in state.items():
      if key == "remainder_slices" and isinstance(value, dict):
        value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
      out[key] = state_from_json(value)
    return out
  if isinstance(state, list):
    return [state_from_json(v) for v in state]
  return state


def index_shuffle(index: int, max_index: int, seed: int, rounds: int) -> int:
  """Grain's own global shuffle of one index (its C++ function), the oracle
  of server/data/shuffle.py."""
  from grain._src.python.experimental.index_shuffle.python import index_shuffle_module  # pylint: disable=g-import-not-at-top
  return index_shuffle_module.index_shuffle(index, max_index, seed, rounds)
