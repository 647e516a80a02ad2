"""A registered dataset: the contract's record stream and its host batches.

`records` is built exactly as the contract states (docs/design.md), with
Grain's own `seed().shuffle().repeat()`; a batch's records are read in one
batched call (Grain's `_getitems` path) rather than one ~60 µs call each.

The fingerprint covers each shard's identity, recorded when the server
started, and shards are read only while they still have it
(server/shard_identity.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Mapping, Sequence

from array_record.python import array_record_data_source
import grain
import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import tree
from grain_elevator.proto.errors import (ConfigError, DataLossError, ShardChangedError,
                                         UnknownDatasetError)
from grain_elevator.proto.spec import DatasetInfo, ElementSpec
from grain_elevator.server import collate as collate_lib
from grain_elevator.server import shard_reader
from grain_elevator.server import shuffle as shuffle_lib
from grain_elevator.server.config import DatasetConfig, ServerConfig
from grain_elevator.server.shard_identity import CheckedFile, ShardIdentity, shard_identities

log = logging.getLogger("grain_elevator.server")

# Where ArrayRecord reads a shard (server/shard_reader.py does not decode
# it): its batched read hands positions to a thread pool, which for small
# records beats ~55 µs per call, but from about this size a call per record
# reads as fast on ~35% less CPU (BENCHMARKS.md).
SINGLE_READ_RECORD_BYTES = 64 << 10


def mark_absl_flags_parsed() -> None:
  """Grain reads absl flags; outside `absl.app.run` they must be marked parsed."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


_UNOPENED = object()


def _raise_for_first_bad_record(filename: str, positions: Sequence[int],
                                read_one: Any, errors: type[Exception] | tuple) -> None:
  """After a batch failed (rare): re-reads its records one by one and raises
  DataLossError naming the first that fails."""
  for p in positions:
    try:
      read_one(p)
    except errors as e:  # pylint: disable=broad-except
      raise DataLossError(
          f"shard {filename} is corrupt: record {p} cannot be read: {e}") from e


class BatchedArrayRecordSource(grain.sources.ArrayRecordDataSource):
  """ArrayRecordDataSource that opts in to Grain's batched-read path.

  Grain calls `_getitems` on sources that offer it. Each shard's positions
  are read in the calling thread by `shard_reader.ShardReader` (one pread
  per chunk, riegeli's hashes checked; ~5 µs of CPU per small record against
  ~20 through ArrayRecord). Shards it does not decode, and builds without
  its C part, go through ArrayRecord: one call per shard, or one per record
  for records of SINGLE_READ_RECORD_BYTES and up (its batched call starts a
  thread pool, which on a few cores costs more than it saves).

  With `identities` (what the server serves), either reader opens a shard
  only through a `CheckedFile` that matched its recorded identity, and each
  read is followed by that file's fstat check: a changed shard is refused
  (ShardChangedError), never read. Without them (tools, tests that damage
  files on purpose) shards are read unchecked.
  """

  _single_reads: bool | None = None

  def __init__(self, paths: Any, reader_options: dict[str, str] | None = None, *,
               identities: Mapping[str, ShardIdentity | None] | None = None):
    super().__init__(paths, reader_options)
    self._identities = identities
    self._shards: list[Any] = [_UNOPENED] * len(self._read_instructions)
    self._files: list[CheckedFile | None] = [None] * len(self._read_instructions)
    self._index_shards()

  def _index_shards(self) -> None:
    """Where each shard's keys end, and key -> position shift, for `_split`."""
    counts = np.asarray([i.num_records for i in self._read_instructions], np.int64)
    starts = np.asarray([i.start for i in self._read_instructions], np.int64)
    self._key_ends = np.cumsum(counts)
    self._key_shift = self._key_ends - counts - starts

  def _reads_singly(self) -> bool:
    if self._single_reads is None:
      try:
        total = sum(os.path.getsize(i.filename) for i in self._read_instructions)
        self._single_reads = total >= SINGLE_READ_RECORD_BYTES * max(1, len(self))
      except (AttributeError, OSError):
        self._single_reads = False
    return self._single_reads

  def __getstate__(self):
    state = super().__getstate__()
    del state["_shards"]  # open file descriptors: reopened (and checked) lazily
    del state["_files"]
    return state

  def __setstate__(self, state):
    super().__setstate__(state)
    self._shards = [_UNOPENED] * len(self._read_instructions)
    self._files = [None] * len(self._read_instructions)

  def _file(self, reader_idx: int) -> CheckedFile | None:
    """The shard's checked file, opened on first use (hold `_lock`); None
    without identities."""
    if self._identities is None:
      return None
    file = self._files[reader_idx]
    if file is None:
      filename = self._read_instructions[reader_idx].filename
      try:
        file = CheckedFile(filename, self._identities.get(filename))
      except OSError as e:
        raise DataLossError(f"shard {filename} cannot be opened: {e}") from e
      self._files[reader_idx] = file
    return file

  def _check(self, reader_idx: int) -> None:
    """After a read (or its failure): refuses a shard written to since it was opened."""
    file = self._files[reader_idx]
    if file is not None:
      file.check()

  def _shard(self, reader_idx: int) -> shard_reader.ShardReader | None:
    """This shard's fast reader, opened on first use; None: use ArrayRecord."""
    shard = self._shards[reader_idx]
    if shard is _UNOPENED:
      with self._lock:
        shard = self._shards[reader_idx]
        if shard is _UNOPENED:
          filename = self._read_instructions[reader_idx].filename
          file = self._file(reader_idx)
          try:
            shard = shard_reader.open_shard(file.path if file else filename)
            if file and shard:
              file.confirm_opened()
          except (shard_reader.CorruptShard, OSError) as e:
            self._check(reader_idx)
            raise DataLossError(f"shard {filename} cannot be opened: {e}") from e
          self._shards[reader_idx] = shard
    return shard

  def _ensure_reader_exists(self, reader_idx: int) -> None:
    """ArrayRecord's reader for a shard, opened through its checked file."""
    if self._identities is None:
      super()._ensure_reader_exists(reader_idx)
      return
    if self._readers[reader_idx] is not None:
      return
    with self._lock:
      if self._readers[reader_idx] is None:
        file = self._file(reader_idx)
        reader = array_record_data_source._create_reader(  # pylint: disable=protected-access
            file.path, self._reader_options_string)
        file.confirm_opened()
        self._readers[reader_idx] = reader

  def _split(self, indices: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
    """shard -> (positions in it, places in `indices`): ArrayRecord's
    `_split_keys_per_reader` with one numpy call for the batch instead of a
    Python call per key (~1.3 µs a record)."""
    keys = np.asarray(indices, np.int64)
    if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
      raise ValueError(f"record keys must be in [0, {len(self)})")
    shards = np.searchsorted(self._key_ends, keys, "right")
    positions = keys - self._key_shift[shards]
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i, (shard, position) in enumerate(zip(shards.tolist(), positions.tolist())):
      group = out.get(shard)
      if group is None:
        group = out[shard] = ([], [])
      group[0].append(position)
      group[1].append(i)
    return out

  def _getitems(self, indices: Sequence[int]) -> Sequence[bytes]:
    out: list[bytes] = [b""] * len(indices)
    for reader_idx, (positions, where) in self._split(indices).items():
      for record, i in zip(self._read(reader_idx, positions), where):
        out[i] = record
    return out

  def _read(self, reader_idx: int, positions: list[int]) -> Sequence[bytes]:
    filename = self._read_instructions[reader_idx].filename
    shard = self._shard(reader_idx)
    if shard is not None:
      try:
        records = shard.read(positions)
      except shard_reader.CorruptShard:
        self._check(reader_idx)  # rewritten in place: say so, not "corrupt"
        _raise_for_first_bad_record(filename, positions,
                                    lambda p: shard.read([p]), shard_reader.CorruptShard)
        raise
      except OSError as e:
        self._check(reader_idx)
        raise DataLossError(f"shard {filename} cannot be read: {e}") from e
      except shard_reader.UnsupportedShard as e:  # a chunk unlike the first
        self._check(reader_idx)
        log.warning("%s: %s; reading it through ArrayRecord from now on", filename, e)
        self._shards[reader_idx] = None
      else:
        # After the read: a write(2) that any of these bytes could come from
        # has already moved the mtime (the kernel sets it before copying in).
        self._check(reader_idx)
        return records
    return self._read_with_array_record(reader_idx, positions)

  def _read_with_array_record(self, reader_idx: int, positions: list[int]) -> Sequence[bytes]:
    filename = self._read_instructions[reader_idx].filename
    try:
      self._ensure_reader_exists(reader_idx)
      reader = self._readers[reader_idx]
      if self._reads_singly():
        records = [reader.read([p])[0] for p in positions]
      else:
        records = reader.read(positions)
    except (ShardChangedError, DataLossError):  # refused before any read
      raise
    except Exception as e:  # pylint: disable=broad-except
      self._check(reader_idx)
      _raise_for_first_bad_record(filename, positions,
                                  lambda p: self._readers[reader_idx].read([p]), Exception)
      raise DataLossError(f"shard {filename} cannot be read: {e}") from e
    self._check(reader_idx)
    return records

  def __getitem__(self, record_key: int) -> bytes:
    (record,) = self._getitems([record_key])
    return record


def build_raw_records(config: DatasetConfig, source: Any | None = None) -> grain.MapDataset:
  """The shuffled, repeated stream of raw records, before the pipeline
  (read unchecked unless `source` is a BatchedArrayRecordSource given identities)."""
  if source is None:
    source = BatchedArrayRecordSource(list(config.files))
  ds = grain.MapDataset.source(source)
  # Grain's per-record read telemetry (prometheus) costs ~14 µs a record, a
  # quarter of a small record's serving time; the server reports its own.
  ds._record_metrics = False  # pylint: disable=protected-access
  ds = ds.seed(config.seed)
  if config.shuffle:
    ds = ds.shuffle()
  return ds.repeat(config.num_epochs or None)


def build_records(config: DatasetConfig, source: Any | None = None) -> grain.MapDataset:
  """The contract's record stream for one dataset (docs/design.md)."""
  return apply_pipeline(config, build_raw_records(config, source))


def apply_pipeline(config: DatasetConfig, ds: grain.MapDataset) -> grain.MapDataset:
  fn = config.pipeline_fn()
  if fn is None:
    return ds
  try:
    out = fn(ds, **config.options)
  except Exception as e:
    raise ConfigError(
        f"dataset {config.name!r}: pipeline {config.pipeline!r} failed: "
        f"{type(e).__name__}: {e} (check [datasets.{config.name}.options])") from e
  if not isinstance(out, grain.MapDataset):
    raise ConfigError(
        f"dataset {config.name!r}: pipeline {config.pipeline!r} returned "
        f"{type(out).__name__}, expected a grain.MapDataset (random access is "
        "what lets any worker serve any step)")
  if len(out) != len(ds):
    raise ConfigError(
        f"dataset {config.name!r}: pipeline {config.pipeline!r} changed the "
        f"number of records ({len(ds)} -> {len(out)}); it must be 1:1 "
        "(map/random_map, no filter or batch)")
  return out


def fingerprint(config: DatasetConfig, num_records: int,
                identities: Mapping[str, ShardIdentity | None]) -> str:
  """The stream fingerprint of a dataset: everything that defines its records,
  its shards' recorded identities included, so a server started on changed
  files has another (and refuses cursors of the old one). File names without
  their folder: the same files elsewhere are the same stream, if their
  copies kept the mtime (cp -p, rsync -a)."""
  shards = [None if i is None else [i.size, i.mtime_ns, i.tail_hash]
            for i in (identities.get(f) for f in config.files)]
  return contract.stream_fingerprint({
      "name": config.name,
      "files": [os.path.basename(f) for f in config.files],
      "shards": shards,
      "num_records": num_records,
      "pipeline": config.pipeline,
      "options": config.options,
      "seed": config.seed,
      "shuffle": config.shuffle,
      "num_epochs": config.num_epochs,
  })


class ElevatorDataset:
  """One registered dataset, ready to cut host batches for any step.

  `identities`: its shards' identities as the server recorded them at
  start-up (`record_identities`); None records them now (embedded mode,
  which opens a dataset on first use). Its shards are read only while they
  still match, and its fingerprint covers them.
  """

  def __init__(self, config: DatasetConfig,
               identities: Mapping[str, ShardIdentity | None] | None = None):
    mark_absl_flags_parsed()
    self.config = config
    try:
      shard_reader.check_setup()
    except ValueError as e:
      raise ConfigError(str(e)) from e
    if identities is None:
      identities = shard_identities(config.files)
    # A file the config's globs match now but did not at start-up has none: refused.
    self.identities = {f: identities.get(f) for f in config.files}
    try:
      source = BatchedArrayRecordSource(list(config.files), identities=self.identities)
    except Exception as e:
      raise ConfigError(
          f"dataset {config.name!r}: cannot open its shards (truncated or not "
          f"ArrayRecord?): {type(e).__name__}: {e}") from e
    num_records = len(source)
    if num_records == 0:
      raise ConfigError(f"dataset {config.name!r}: its files hold no records")
    self._source = source
    self.raw_records = build_raw_records(config, source)
    # The same chain over range(n) yields source indices: the reference for
    # the batch-at-a-time shuffle that raw_batch uses.
    self._source_index = shuffle_lib.SourceIndexMap(
        build_raw_records(config, range(num_records)), num_records)
    self.records = apply_pipeline(config, self.raw_records)
    try:
      first = self.records[0]
    except ShardChangedError:
      raise
    except Exception as e:
      raise ConfigError(
          f"dataset {config.name!r}: the pipeline fails on record 0: "
          f"{type(e).__name__}: {e}") from e
    spec = ElementSpec.of(first)
    self._leaf_specs = [(l.path, l.dtype, l.shape) for l in spec.leaves]
    self.info = DatasetInfo(
        name=config.name, num_records=num_records,
        num_epochs=config.num_epochs, shuffle=config.shuffle, seed=config.seed,
        config_fingerprint=fingerprint(config, num_records, self.identities),
        element_spec=spec, stream_length=len(self.records))
    self._batch_fn = config.batch_transform_fn()
    if self._batch_fn is not None:
      self._verify_batch_transform(min(num_records, 64))

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
      fast = self._transform_batch(positions)
    except ShardChangedError:
      raise
    except Exception as e:
      raise ConfigError(
          f"dataset {c.name!r}: batch_transform {c.batch_transform!r} fails on "
          f"{where}: {type(e).__name__}: {e}") from e
    slow = self._collate_records(positions)
    for (path, _, _), a, b in zip(self._leaf_specs, fast, slow):
      if a.tobytes() != b.tobytes():
        raise ConfigError(
            f"dataset {c.name!r}: batch_transform {c.batch_transform!r} does not "
            f"reproduce pipeline {c.pipeline!r}: leaf {path!r} differs on "
            f"{where}; it must give exactly the per-record rows, stacked")

  def _collate_records(self, positions: list[int], stack: bool = True
                       ) -> list[collate_lib.Leaf]:
    rows = self.records._getitems(positions)  # pylint: disable=protected-access
    return collate_lib.collate(rows, self.info.element_spec.structure, self._leaf_specs,
                               stack=stack)

  def raw_batch(self, positions: Sequence[int]) -> Sequence[bytes]:
    """The raw records at these stream positions: `raw_records`' items,
    with the shuffle computed for the whole batch (server/shuffle.py)."""
    return self._source._getitems(self._source_index(positions))  # pylint: disable=protected-access

  def _transform_batch(self, positions: list[int], stack: bool = True
                       ) -> list[collate_lib.Leaf]:
    raw = self.raw_batch(positions)
    out = self._batch_fn(raw, **self.config.options)
    leaves, structure, _ = tree.flatten(out)
    return collate_lib.check_batch(leaves, structure, len(positions),
                                   self.info.element_spec.structure, self._leaf_specs,
                                   stack=stack)

  def host_batch_leaves(self, step: int, global_batch_size: int,
                        shard_index: int, shard_count: int, *,
                        stack: bool = True) -> list[collate_lib.Leaf]:
    """Host h's rows of global batch `step`, one stacked array per leaf.

    `stack=False` (the servers' send path) may leave leaves of big rows as
    RowStacks, which the socket gathers without a stacking copy
    (proto/rows.py); the bytes sent are the same.
    """
    positions = list(contract.host_positions(step, global_batch_size, shard_index,
                                             shard_count))
    if self._batch_fn is not None:
      return self._transform_batch(positions, stack)
    return self._collate_records(positions, stack)


class Datasets:
  """A config's datasets by name, each opened once: every one at start-up
  (a server: a bad dataset stops it before it serves), or each on first use
  (embedded mode opens only what the trainer reads).

  `identities`: the shards' identities the supervisor recorded when the
  server started (`record_identities`), the same for every worker however
  late it starts; None records each dataset's when it is opened.
  """

  def __init__(self, config: ServerConfig, *, open_now: bool = True,
               identities: Mapping[str, ShardIdentity] | None = None):
    self.config = config
    self._identities = identities
    self._opened: dict[str, ElevatorDataset] = {}
    self._lock = threading.Lock()
    if open_now:
      for name in config.datasets:
        self.get(name)

  @property
  def names(self) -> list[str]:
    return sorted(self.config.datasets)

  def get(self, name: str) -> ElevatorDataset:
    """The opened dataset; UnknownDatasetError (NOT_FOUND) naming what exists."""
    with self._lock:
      ds = self._opened.get(name)
      if ds is None:
        dataset_config = self.config.datasets.get(name)
        if dataset_config is None:
          raise UnknownDatasetError(
              f"unknown dataset {name!r}; this server offers: "
              f"{', '.join(self.names) or '(none)'}")
        ds = self._opened[name] = ElevatorDataset(dataset_config, self._identities)
      return ds
