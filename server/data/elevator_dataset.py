"""A registered 1:1 dataset: the contract's record stream and its host
batches, any step found in O(1) (a StepDataset, step_dataset.py).

Its records are records.py's; a batch's records are read in one batched
call (Grain's `_getitems` path) rather than one ~60 µs call each, and
where a whole-batch decode is given (`batch_transform`, or TFDS's batch
decoder) it is checked at start-up to give the per-record pipeline's rows.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import tree
from grain_elevator.proto.errors import ConfigError, ShardChangedError
from grain_elevator.proto.spec import DatasetInfo, ElementSpec
from grain_elevator.server.data import collate as collate_lib
from grain_elevator.server.data import grain_private
from grain_elevator.server.data import shuffle as shuffle_lib
from grain_elevator.server.data.config import DatasetConfig
from grain_elevator.server.data.records import (OpenedSource, apply_pipeline, build_raw_records,
                                                fingerprint, record_origins)
from grain_elevator.server.data.shards.identity import ShardIdentity
from grain_elevator.server.data.shards.option_files import OptionFiles

log = logging.getLogger("grain_elevator.server")

# A whole-batch decode (batch_transform, TFDS's batch decoder) must give the
# per-record pipeline's rows: checked at start-up on this many positions at
# the start of epoch 0 and of epoch 1.
BATCH_CHECK_RECORDS = 64


class ElevatorDataset:
  """One registered dataset, ready to cut host batches for any step.

  `identities`: its shards' identities as the server recorded them at
  start-up (`record_identities`); None records them now (embedded mode,
  which opens a dataset on first use). Its shards are read only while they
  still match, and its fingerprint covers them, and the files its options
  name (`files`; None: recorded now).
  """

  def __init__(self, config: DatasetConfig,
               identities: Mapping[str, ShardIdentity | None] | None = None, *,
               opened: OpenedSource | None = None, records: grain.MapDataset | None = None,
               files: OptionFiles | None = None):
    """`opened` and `records` (its raw records with the pipeline applied):
    what `open_dataset` found already, else opened here."""
    self.config = config
    files = files if files is not None else OptionFiles(config, None)
    opened = opened or OpenedSource.open(config, identities)
    self.identities = opened.identities
    num_records = opened.num_records
    self._source = opened.source
    self.raw_records = opened.raw_records
    # The same chain over range(n) yields source indices: the reference for
    # the batch-at-a-time shuffle that raw_batch uses.
    self._source_index = shuffle_lib.SourceIndexMap(
        build_raw_records(config, range(num_records)), num_records)
    self.records = records if records is not None else apply_pipeline(config, self.raw_records)
    try:
      first = self.records[0]
    except ShardChangedError:
      raise
    except Exception as e:
      raise ConfigError(
          f"dataset {config.name!r}: the pipeline fails on record 0: "
          f"{type(e).__name__}: {e}") from e
    # The spec of a record; a batch's is the same, plus the mask in evaluation mode.
    self._record_spec = ElementSpec.of(first)
    self._leaf_specs = [(l.path, l.dtype, l.shape) for l in self._record_spec.leaves]
    self.info = DatasetInfo(
        name=config.name, num_records=num_records,
        num_epochs=config.num_epochs, shuffle=config.shuffle, seed=config.seed,
        config_fingerprint=fingerprint(config, num_records, self.identities, files),
        element_spec=self._batch_spec(first), stream_length=len(self.records),
        drop_remainder=config.drop_remainder)
    self._batch_fn = config.batch_transform_fn()
    if self._batch_fn is not None:
      self._verify_batch_transform(min(num_records, BATCH_CHECK_RECORDS))
    elif config.tfds is not None and config.pipeline is None:
      self._use_tfds_batch_decoder(min(num_records, BATCH_CHECK_RECORDS))

  def _batch_spec(self, first: Any) -> ElementSpec:
    """The record spec, with evaluation mode's mask leaf where it applies."""
    if self.config.drop_remainder:
      return self._record_spec
    if not isinstance(first, dict) or contract.MASK_KEY in first:
      raise ConfigError(
          f"dataset {self.config.name!r}: drop_remainder = false (evaluation mode) "
          f"needs records that are dicts without a {contract.MASK_KEY!r} key, for the "
          f"mask it adds; record 0 is {type(first).__name__}"
          + (f" with keys {sorted(first)}" if isinstance(first, dict) else ""))
    spec = ElementSpec.of({**first, contract.MASK_KEY: np.bool_(True)})
    self._mask_index = [l.path for l in spec.leaves].index(contract.MASK_KEY)
    return spec

  def _use_tfds_batch_decoder(self, rows: int) -> None:
    """A TFDS dataset served as decoded (no pipeline): where its features
    allow, a whole batch is decoded at once, checked like a batch_transform
    against TFDS's per-record decode; where not, or if the check fails, the
    per-record decode stays."""
    from grain_elevator.server.data import tfds_source  # pylint: disable=g-import-not-at-top
    self._batch_fn = tfds_source.batch_decoder(self.config.tfds)
    if self._batch_fn is None:
      return
    try:
      self._verify_batch_transform(rows)
    except ConfigError as e:
      log.warning("%s; decoding its records one by one", e)
      self._batch_fn = None

  def _verify_batch_transform(self, rows: int) -> None:
    """Refuses a batch_transform that does not reproduce the pipeline, on
    the first positions of epoch 0 and, where the stream has one, epoch 1."""
    n = self.info.num_records
    positions = list(range(rows))
    if self.info.stream_length >= 2 * n:
      positions += [n + p for p in range(rows)]
    c = self.config
    where = f"positions {positions[0]}..{positions[rows - 1]}" + (
        f" and {n}..{n + rows - 1}" if len(positions) > rows else "")
    try:
      fast = self._transform_batch(positions, fall_back=False)
    except ShardChangedError:
      raise
    except Exception as e:
      raise ConfigError(
          f"dataset {c.name!r}: batch_transform {c.batch_transform or self._batch_fn!r} fails on "
          f"{where}: {type(e).__name__}: {e}") from e
    slow = self._collate_records(positions)
    for (path, _, _), a, b in zip(self._leaf_specs, fast, slow):
      if a.tobytes() != b.tobytes():
        raise ConfigError(
            f"dataset {c.name!r}: batch_transform {c.batch_transform or self._batch_fn!r} does not "
            f"reproduce pipeline {c.pipeline!r}: leaf {path!r} differs on "
            f"{where}; it must give exactly the per-record rows, stacked")

  def _collate_records(self, positions: list[int], stack: bool = True
                       ) -> list[collate_lib.Leaf]:
    rows = grain_private.getitems(self.records, positions)
    return collate_lib.collate(rows, self._record_spec.structure, self._leaf_specs,
                               stack=stack)

  def raw_batch(self, positions: Sequence[int]) -> Sequence[bytes]:
    """The raw records at these stream positions: `raw_records`' items,
    with the shuffle computed for the whole batch (server/data/shuffle.py)."""
    return self._source.read_raw(self._source_index(positions))

  def _transform_batch(self, positions: list[int], stack: bool = True, *,
                       fall_back: bool = True) -> list[collate_lib.Leaf]:
    raw = self.raw_batch(positions)
    try:
      out = self._batch_fn(raw, **self.config.options)
    except Exception as e:  # pylint: disable=broad-except
      if not fall_back:
        raise
      # The per-record path gives the same rows by contract, and names the
      # record that fails (DATA_LOSS for a record TFDS cannot decode).
      log.warning("dataset %r: batch_transform failed (%s: %s); reading these "
                  "records one by one", self.config.name, type(e).__name__, e)
      return self._collate_records(positions, stack)
    leaves, structure, _ = tree.flatten(out)
    return collate_lib.check_batch(leaves, structure, len(positions),
                                   self._record_spec.structure, self._leaf_specs,
                                   stack=stack)

  def check_batch_size(self, global_batch_size: int) -> None:
    """Any G the contract allows is served (StepDataset)."""
    del global_batch_size

  def host_batch_leaves(self, step: int, global_batch_size: int,
                        shard_index: int, shard_count: int, *, record_offset: int = 0,
                        stack: bool = True) -> list[collate_lib.Leaf]:
    """Host h's rows of global batch `step` (counted from `record_offset`),
    one stacked array per leaf.

    `stack=False` (the servers' send path) may leave leaves of big rows as
    RowStacks, which the socket gathers without a stacking copy
    (proto/rows.py); the bytes sent are the same.
    """
    positions = list(contract.host_positions(step, global_batch_size, shard_index,
                                             shard_count, record_offset))
    if self.config.drop_remainder:
      return self._rows(positions, stack)
    # Evaluation mode: positions past the stream are zero rows, masked out.
    real = min(len(positions), max(0, self.info.stream_length - positions[0]))  # a prefix
    if real == len(positions):
      leaves = self._rows(positions, stack)
    else:
      leaves = [np.zeros((len(positions), *shape), dtype) for _, dtype, shape in self._leaf_specs]
      if real:
        for padded, rows in zip(leaves, self._rows(positions[:real], stack=True)):
          padded[:real] = rows
    mask = np.zeros(len(positions), dtype=np.bool_)
    mask[:real] = True
    leaves.insert(self._mask_index, mask)
    return leaves

  def origins(self, positions: Sequence[int]) -> list[dict[str, Any]]:
    """Where the records at these stream positions come from
    (server/data/provenance.py)."""
    return record_origins(self._source, self._source_index, positions)

  def read_needs(self, step: int, global_batch_size: int, shard_index: int,
                 shard_count: int, record_offset: int = 0) -> list[Any] | None:
    """What producing host h's rows of `step` reads from a bucket: per
    object, its chunks' extents (server/serving/read_plan.py plans them);
    None for shards on local disk (StepDataset)."""
    if self.component_needs([]) is None:
      return None
    positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                        record_offset)
    real = min(len(positions), max(0, self.info.stream_length - positions.start))
    if self.config.drop_remainder and real < len(positions):
      return []  # past the stream: the step is refused, nothing is read
    return self.component_needs(list(positions[:real]))

  def component_needs(self, positions: list[int]) -> list[Any] | None:
    """What reading the records at these stream positions needs from a
    bucket: per object, its chunks' extents; None for local shards."""
    needs = getattr(self._source, "needs", None)
    if needs is None:
      return None
    return needs(self._source_index(positions)) if positions else []

  def component_rows(self, positions: list[int]) -> list[np.ndarray]:
    """Stacked rows at these stream positions, for a mixture (server/data/mixture.py)."""
    return self._rows(positions, stack=True)

  def _rows(self, positions: list[int], stack: bool) -> list[collate_lib.Leaf]:
    if self._batch_fn is not None:
      return self._transform_batch(positions, stack)
    return self._collate_records(positions, stack)
