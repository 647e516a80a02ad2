"""A mixture: a dataset whose records are drawn from other registered datasets.

The contract (docs/design.md): segment i of the schedule covers global steps
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

import numpy as np
from grain._src.python.dataset.transformations import mix as grain_mix

from grain_elevator.proto import contract
from grain_elevator.proto.errors import ConfigError, InvalidRequestError
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server.config import DatasetConfig


@dataclasses.dataclass(frozen=True)
class _Segment:
  first_step: int
  components: tuple[int, ...]  # indices into the mixture's component list, weight > 0
  proportions: tuple[int, ...]  # Grain's integer proportions of those


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
  """A mixture over opened component datasets (server/dataset.py's
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
          grain_mix._float_to_int_proportions([w for _, w in used]))))  # pylint: disable=protected-access
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

  def locate(self, position: int, global_batch_size: int) -> tuple[int, int]:
    """(component, index in its stream) of the mixture's record `position`."""
    starts = [s.first_step * global_batch_size for s in self._segments]
    i = max(k for k, start in enumerate(starts) if start <= position)
    seg = self._segments[i]
    which, key = grain_mix._dataset_and_key_of_next_element(  # pylint: disable=protected-access
        position - starts[i], seg.proportions)
    j = seg.components[which]
    return j, self._offsets(global_batch_size)[i][j] + key

  def host_batch_leaves(self, step: int, global_batch_size: int, shard_index: int,
                        shard_count: int, *, record_offset: int = 0,
                        stack: bool = True) -> list[np.ndarray]:
    del stack  # rows from several components are always stacked here
    if record_offset and len(self._segments) > 1:
      raise InvalidRequestError(
          f"dataset {self.config.name!r}: a scheduled mixture's segments are counted in "
          "steps of the global batch size, so it cannot change at a checkpoint")
    positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                        record_offset)
    picks = [self.locate(p, global_batch_size) for p in positions]
    specs = self.info.element_spec.leaves
    out = [np.empty((len(picks), *l.shape), l.dtype) for l in specs]
    for j, ds in enumerate(self.components):
      rows = [r for r, (c, _) in enumerate(picks) if c == j]
      if not rows:
        continue
      leaves = ds.component_rows([picks[r][1] for r in rows])
      for dst, src in zip(out, leaves):
        dst[rows] = src
    return out


def _describe(info: DatasetInfo) -> str:
  return ", ".join(f"{l.path}: {l.dtype}{list(l.shape)}" for l in info.element_spec.leaves)
