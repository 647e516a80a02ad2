"""A mixture: a dataset whose records are drawn from other registered datasets.

The contract (docs/concepts.md): segment i of the schedule covers global steps
[s_i, s_{i+1}). Record r of segment i, counted from the segment's first
record, is `grain.MapDataset.mix([C_0, C_1, ...], weights_i)[r]` in Grain's
own semantics (integer proportions, periodic selection; components of
weight 0 take no part), where C_j is component j's record stream, repeated
forever, offset by the number of its records that earlier segments used.
So a weight change skips and repeats nothing, and any record is found in
O(#segments x #components).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import grain
import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto.errors import ConfigError, InvalidRequestError
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server.data import grain_private
from grain_elevator.server.data.config import DatasetConfig


# Grain's selection repeats every sum(proportions) records, each component's
# key advancing by its proportion per period; a period up to this long is
# tabulated once, so a batch is located with a few numpy operations.
_MAX_TABLE = 1 << 20


@dataclasses.dataclass(frozen=True)
class _Segment:
  first_step: int
  components: tuple[int, ...]  # indices into the mixture's component list, weight > 0
  proportions: tuple[int, ...]  # Grain's integer proportions of those

  @functools.cached_property
  def table(self) -> tuple[np.ndarray, np.ndarray] | None:
    """(which, key) of each record of one period, from Grain's own function."""
    period = sum(self.proportions)
    if period > _MAX_TABLE:
      return None
    picks = [grain_private.mix_pick(r, self.proportions)
             for r in range(period)]
    return (np.array([w for w, _ in picks], np.int64), np.array([k for _, k in picks], np.int64))

  def locate(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(component, key in its segment stream) of records counted from the segment's start."""
    table = self.table
    if table is None:
      picks = [grain_private.mix_pick(int(r), self.proportions)
               for r in records]
      which = np.array([w for w, _ in picks], np.int64)
      keys = np.array([k for _, k in picks], np.int64)
    else:
      period = len(table[0])
      which = table[0][records % period]
      keys = table[1][records % period] + records // period * np.asarray(self.proportions)[which]
    return np.asarray(self.components, np.int64)[which], keys


def _counts(records: int, proportions: Sequence[int]) -> list[int]:
  """How many of the first `records` records of a mix each component gives:
  the recursion of Grain's `_dataset_and_key_of_next_element`, summed."""
  remaining, current, out = sum(proportions), records, []
  for p in proportions:
    rest = current * (remaining - p) // remaining
    out.append(current - rest)
    remaining -= p
    current = rest
  return out


class MixtureDataset:
  """A mixture over opened component datasets (server/data/elevator_dataset.py's
  ElevatorDataset, each reading its stream repeated forever)."""

  def __init__(self, config: DatasetConfig, open_component: Callable[[str], Any]):
    assert config.schedule is not None
    self.config = config
    self.names = list(dict.fromkeys(c for _, weights in config.schedule for c, _ in weights))
    self.components = [open_component(n) for n in self.names]
    first = self.components[0].info
    for name, ds in zip(self.names[1:], self.components[1:]):
      if ds.info.element_spec != first.element_spec:
        raise ConfigError(
            f"dataset {config.name!r}: components {self.names[0]!r} and {name!r} have "
            f"different element structure ({_describe(first)} against {_describe(ds.info)}); "
            "a batch must have one")
    self._segments = []
    for step, weights in config.schedule:
      used = [(self.names.index(c), w) for c, w in weights if w > 0]
      self._segments.append(_Segment(step, tuple(i for i, _ in used), tuple(
          grain_private.mix_proportions([w for _, w in used]))))
    components = {n: d.info.config_fingerprint for n, d in zip(self.names, self.components)}

    def through(i: int) -> str:  # the components and the entries up to segment i
      return contract.stream_fingerprint({
          "mixture": [[s, [list(cw) for cw in w]] for s, w in config.schedule[:i + 1]],
          "components": components})

    self.info = DatasetInfo(
        name=config.name, num_records=sum(d.info.num_records for d in self.components),
        num_epochs=0, shuffle=False, seed=0,
        config_fingerprint=through(len(config.schedule) - 1),
        element_spec=first.element_spec, stream_length=contract.FOREVER_LENGTH,
        segment_steps=tuple(s for s, _ in config.schedule),
        segment_fingerprints=tuple(through(i) for i in range(len(config.schedule))))

  def fixed_records(self) -> grain.MapDataset:
    """The records of a mixture of fixed weights as Grain itself mixes them:
    what a stream dataset naming it as its `source` reads."""
    if len(self._segments) != 1:
      raise ConfigError(f"dataset {self.config.name!r}: a mixture with a schedule cannot be "
                        "a stream's source (its records depend on G)")
    (segment,) = self._segments
    _, weights = self.config.schedule[0]
    return grain.MapDataset.mix([self.components[j].records for j in segment.components],
                                [w for _, w in weights if w > 0])

  def check_batch_size(self, global_batch_size: int) -> None:
    """InvalidRequestError unless every schedule entry's first record,
    step x G, is a position a stream can hold (an int64): a client's G must
    not overflow the arithmetic that locates records."""
    last = self._segments[-1].first_step
    if last * global_batch_size > contract.FOREVER_LENGTH:
      raise InvalidRequestError(
          f"dataset {self.config.name!r}: global_batch_size {global_batch_size} puts its "
          f"schedule entry at step {last} at record {last * global_batch_size}, past the "
          f"last position a stream has ({contract.FOREVER_LENGTH}); use a "
          f"global_batch_size of at most {contract.FOREVER_LENGTH // last}")

  @functools.lru_cache(maxsize=8)
  def _offsets(self, global_batch_size: int) -> tuple[tuple[int, ...], ...]:
    """Per segment, each component's records used by the segments before it."""
    used = [0] * len(self.components)
    out = []
    for seg, nxt in zip(self._segments, [*self._segments[1:], None]):
      out.append(tuple(used))
      if nxt is not None:
        records = (nxt.first_step - seg.first_step) * global_batch_size
        for j, n in zip(seg.components, _counts(records, seg.proportions)):
          used[j] += n
    return tuple(out)

  def locate(self, positions: np.ndarray, global_batch_size: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(component, index in its stream) of each of the mixture's records at `positions`."""
    self.check_batch_size(global_batch_size)
    starts = np.array([s.first_step * global_batch_size for s in self._segments], np.int64)
    segment = np.searchsorted(starts, positions, side="right") - 1
    offsets = np.array(self._offsets(global_batch_size), np.int64)
    component = np.empty(len(positions), np.int64)
    index = np.empty(len(positions), np.int64)
    for i in np.unique(segment):
      rows = segment == i
      c, k = self._segments[i].locate(positions[rows] - starts[i])
      component[rows], index[rows] = c, offsets[i][c] + k
    return component, index

  def read_needs(self, step: int, global_batch_size: int, shard_index: int,
                 shard_count: int, record_offset: int = 0) -> list[Any] | None:
    """What producing host h's rows of `step` reads from buckets: per
    object, its chunks' extents, over the components; None where none is in
    a bucket (StepDataset)."""
    if all(ds.component_needs([]) is None for ds in self.components):
      return None
    if record_offset and len(self._segments) > 1:
      return []  # refused when asked for (host_batch_leaves)
    positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                        record_offset)
    component, index = self.locate(np.arange(positions.start, positions.stop, dtype=np.int64),
                                   global_batch_size)
    out: list[Any] = []
    for j, ds in enumerate(self.components):
      rows = np.flatnonzero(component == j)
      if len(rows):
        out += ds.component_needs(index[rows].tolist()) or []
    return out

  def host_batch_leaves(self, step: int, global_batch_size: int, shard_index: int,
                        shard_count: int, *, record_offset: int = 0,
                        stack: bool = True) -> list[np.ndarray]:
    del stack  # rows from several components are always stacked here
    self.check_batch_size(global_batch_size)
    if record_offset and len(self._segments) > 1:
      raise InvalidRequestError(
          f"dataset {self.config.name!r}: a scheduled mixture's segments are counted in "
          "steps of the global batch size, so it cannot change at a checkpoint")
    positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                        record_offset)
    component, index = self.locate(np.arange(positions.start, positions.stop, dtype=np.int64),
                                   global_batch_size)
    out = [np.empty((len(positions), *l.shape), l.dtype) for l in self.info.element_spec.leaves]
    for j, ds in enumerate(self.components):
      rows = np.flatnonzero(component == j)
      if len(rows):
        for dst, src in zip(out, ds.component_rows(index[rows].tolist())):
          dst[rows] = src
    return out


def _describe(info: DatasetInfo) -> str:
  return ", ".join(f"{l.path}: {l.dtype}{list(l.shape)}" for l in info.element_spec.leaves)
