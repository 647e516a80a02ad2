"""A registered dataset: the contract's record stream and its host batches.

`records` is built exactly as the contract states (docs/concepts.md), with
Grain's own `seed().shuffle().repeat()`; a batch's records are read in one
batched call (Grain's `_getitems` path) rather than one ~60 µs call each.

The fingerprint covers each shard's identity, recorded when the server
started, and shards are read only while they still have it
(server/data/shards/identity.py); likewise the files its options name
(server/data/shards/option_files.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from grain_elevator import pipelines

from grain_elevator.proto import contract
from grain_elevator.proto import tree
from grain_elevator.proto.errors import ConfigError, ShardChangedError, UnknownDatasetError
from grain_elevator.proto.spec import DatasetInfo, ElementSpec
from grain_elevator.server.data import collate as collate_lib
from grain_elevator.server.data import grain_private
from grain_elevator.server.data import shuffle as shuffle_lib
from grain_elevator.server.data.config import DatasetConfig, ServerConfig
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.served import ServedDataset
from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server.data.shards.identity import (ObjectIdentity, Recorded,
                                                        ShardIdentity, shard_identities)
from grain_elevator.server.data.shards.option_files import OptionFiles
from grain_elevator.server.data.storage import urls
from grain_elevator.server.data.stream import is_stream_pipeline

log = logging.getLogger("grain_elevator.server")

# A whole-batch decode (batch_transform, TFDS's batch decoder) must give the
# per-record pipeline's rows: checked at start-up on this many positions at
# the start of epoch 0 and of epoch 1.
BATCH_CHECK_RECORDS = 64

__all__ = ["BatchedArrayRecordSource", "Datasets", "ElevatorDataset", "build_records"]


def mark_absl_flags_parsed() -> None:
  """Grain reads absl flags; outside `absl.app.run` they must be marked parsed."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def build_raw_records(config: DatasetConfig, source: Any | None = None) -> grain.MapDataset:
  """The shuffled, repeated stream of raw records, before the pipeline
  (read unchecked unless `source` is a BatchedArrayRecordSource given identities)."""
  if source is None:
    source = open_source(config)
  ds = grain_private.without_read_metrics(grain.MapDataset.source(source))
  ds = ds.seed(config.seed)
  if config.shuffle:
    ds = ds.shuffle()
  return ds.repeat(config.num_epochs or None)


def open_source(config: DatasetConfig,
                identities: Mapping[str, ShardIdentity | None] | None = None
                ) -> BatchedArrayRecordSource:
  """The dataset's record source: its ArrayRecord shards as raw bytes, or a
  TFDS split's records decoded as `tfds.data_source` decodes them."""
  if config.tfds is not None:
    from grain_elevator.server.data import tfds_source  # pylint: disable=g-import-not-at-top
    return tfds_source.TfdsSource(config.tfds, identities=identities)
  if config.files and urls.is_url(config.files[0]):
    from grain_elevator.server.data.object_source import ObjectRecordSource  # pylint: disable=g-import-not-at-top
    return ObjectRecordSource(config.files, config.storage, identities=identities,
                              dataset=config.name)
  return BatchedArrayRecordSource(list(config.files), identities=identities)


def build_records(config: DatasetConfig, source: Any | None = None) -> grain.MapDataset:
  """The contract's record stream for one dataset (docs/concepts.md)."""
  return apply_pipeline(config, build_raw_records(config, source))


def apply_pipeline(config: DatasetConfig, ds: grain.MapDataset, *,
                   one_to_one: bool = True) -> grain.MapDataset:
  """`pipeline(ds, **options)`; `one_to_one`: refuse one that changes the
  number of records (a stream dataset's may: server/data/stream.py)."""
  fn = config.pipeline_fn()
  if fn is None:
    return ds
  try:
    with pipelines.building_from(config.base_dir):
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
  if one_to_one and is_stream_pipeline(ds, out):
    raise ConfigError(
        f"dataset {config.name!r}: pipeline {config.pipeline!r} filters or flat-maps: "
        "that makes it a stream dataset, which cannot be a mixture's component "
        "(a component is read by record position)")
  if one_to_one and len(out) != len(ds):
    raise ConfigError(
        f"dataset {config.name!r}: pipeline {config.pipeline!r} changed the "
        f"number of records ({len(ds)} -> {len(out)}); it must be 1:1 "
        "(map/random_map, no filter or batch)")
  return out


def fingerprint(config: DatasetConfig, num_records: int,
                identities: Mapping[str, ShardIdentity | ObjectIdentity | None],
                files: OptionFiles | None = None) -> str:
  """The stream fingerprint of a dataset: everything that defines its records,
  its shards' recorded identities included, so a server started on changed
  files has another (and refuses cursors of the old one). The shards count
  by their content alone, in order: each one's size and the hash of its
  last IDENTITY_TAIL_BYTES (ArrayRecord's postscript and the end of its
  footer, the chunk index; the whole shard when it is smaller), never a
  path, mtime or ETag. So the same shards on another disk or in a bucket
  (gs://, s3://) are the same stream, and a cursor moves between copies.
  The files its options name count by their content (`files`)."""
  shards = [None if i is None else [i.size, i.tail_hash]
            for i in (identities.get(f) for f in config.files)]
  fields: dict[str, Any] = {}
  if files is not None and files.files:  # absent otherwise: other datasets' cursors stay valid
    fields["option_files"] = files.fingerprint_fields()
  if config.tfds is not None:  # absent otherwise: other datasets' cursors stay valid
    fields["tfds"] = config.tfds.fingerprint_fields()
  if not config.drop_remainder:  # likewise
    fields["drop_remainder"] = False
  if config.iter_pipeline or config.batch_fn or config.iter_options:  # likewise
    fields["stream"] = {"iter_pipeline": config.iter_pipeline, "batch_fn": config.batch_fn,
                        "iter_options": config.iter_options}
  return contract.stream_fingerprint({
      **fields,
      "name": config.name,
      "shards": shards,
      "num_records": num_records,
      "pipeline": config.pipeline,
      "options": config.options,
      "seed": config.seed,
      "shuffle": config.shuffle,
      "num_epochs": config.num_epochs,
  })


@dataclasses.dataclass
class OpenedSource:
  """A dataset's shards opened (through their recorded identities) and its
  raw record stream: seed, shuffle, repeat."""

  identities: dict[str, ShardIdentity | None]
  source: Any
  raw_records: grain.MapDataset

  @property
  def num_records(self) -> int:
    return len(self.source)

  @classmethod
  def open(cls, config: DatasetConfig,
           identities: Mapping[str, ShardIdentity | None] | None) -> "OpenedSource":
    mark_absl_flags_parsed()
    try:
      shard_reader.check_setup()
    except ValueError as e:
      raise ConfigError(str(e)) from e
    if identities is None:
      identities = shard_identities(config.files, dataset=config.name, storage=config.storage)
    # A file the config's globs match now but did not at start-up has none: refused.
    checked = {f: identities.get(f) for f in config.files}
    try:
      source = open_source(config, checked)
    except (ConfigError, ShardChangedError):
      raise
    except Exception as e:
      raise ConfigError(
          f"dataset {config.name!r}: cannot open its shards (truncated or not "
          f"ArrayRecord?): {type(e).__name__}: {e}") from e
    if len(source) == 0:
      raise ConfigError(f"dataset {config.name!r}: its files hold no records")
    return cls(checked, source, build_raw_records(config, source))


def record_origins(source: Any, source_index: Callable[[Sequence[int]], list[int]],
                   positions: Sequence[int]) -> list[dict[str, Any]]:
  """For each stream position: its epoch, the source record behind it
  (after the shuffle), and the shard and record index holding that."""
  n = len(source)
  locate = getattr(source, "locate", None)
  out = []
  for p, key in zip(positions, source_index(positions)):
    row: dict[str, Any] = {"position": int(p), "epoch": int(p) // n, "source_index": int(key)}
    if locate is not None:
      row["shard"], row["record"] = locate(int(key))
    else:
      row["where"] = source.where(int(key))
    out.append(row)
  return out


def open_dataset(config: DatasetConfig,
                 identities: Mapping[str, ShardIdentity | None] | None,
                 files: OptionFiles,
                 open_forever: Callable[[str], "ElevatorDataset"],
                 open_named: Callable[[str], ServedDataset]) -> ServedDataset:
  """A registered dataset as the request path serves it: a mixture, a
  stream dataset (a pipeline that is not 1:1, or one the config makes so),
  or a dataset whose steps map to records in O(1). `files`: those its
  options name, checked by the caller before and after."""
  from grain_elevator.server.data import stream  # pylint: disable=g-import-not-at-top
  if config.schedule is not None:
    from grain_elevator.server.data.mixture import MixtureDataset  # pylint: disable=g-import-not-at-top
    return MixtureDataset(config, open_forever)
  if config.source is not None:  # a mixture's records, mixed by Grain itself
    mixture = open_named(config.source)
    records = mixture.fixed_records()
    num_records, fp = mixture.info.num_records, mixture.info.config_fingerprint
    head = apply_pipeline(config, records, one_to_one=False)
    fields = {"option_files": files.fingerprint_fields()} if files.files else {}
    ds = stream.StreamDataset(config, records, head, num_records=num_records,
                                fingerprint=contract.stream_fingerprint({
                                    **fields,
                                    "name": config.name, "source": fp,
                                    "pipeline": config.pipeline, "options": config.options,
                                    "drop_remainder": config.drop_remainder,
                                    "iter_pipeline": config.iter_pipeline,
                                    "batch_fn": config.batch_fn,
                                    "iter_options": config.iter_options}),
                                check_files=_iter_files_check(files))
    from grain_elevator.server.data import provenance  # pylint: disable=g-import-not-at-top
    ds.origins = functools.partial(provenance.mixture_origins, mixture, global_batch_size=1)
    ds.component_names = tuple(mixture.names)
    ds.component_of = lambda positions: mixture.locate(positions, 1)[0]
    return ds
  opened = OpenedSource.open(config, identities)
  head = apply_pipeline(config, opened.raw_records, one_to_one=False)
  if config.names_a_stream or stream.is_stream_pipeline(opened.raw_records, head):
    if config.batch_transform is not None:
      raise ConfigError(
          f"dataset {config.name!r}: its pipeline filters or flat-maps, so it is a stream "
          "dataset, and 'batch_transform' (a whole-batch decode of a 1:1 pipeline) cannot "
          "apply; give a 'batch_fn' instead")
    ds = stream.StreamDataset(config, opened.raw_records, head,
                              num_records=opened.num_records,
                              fingerprint=_stream_fingerprint(config, opened, files),
                              check_files=_iter_files_check(files))
    ds.identities = opened.identities
    index = shuffle_lib.SourceIndexMap(build_raw_records(config, range(opened.num_records)),
                                       opened.num_records)
    ds.origins = functools.partial(record_origins, opened.source, index)
    needs = getattr(opened.source, "needs", None)  # in a bucket
    if needs is not None:
      ds.read_by_plan(lambda positions: needs(index(positions)))
    return ds
  return ElevatorDataset(config, identities, opened=opened, records=head, files=files)


def _iter_files_check(files: OptionFiles) -> Callable[[], None] | None:
  """What a stream runs before each build of its iter_pipeline, which may
  read its `iter_options` files again: their check (None: there are none)."""
  if not any(f.where.startswith("iter_options.") for f in files.files):
    return None
  return lambda: files.check("iter_options")


def _stream_fingerprint(config: DatasetConfig, opened: OpenedSource,
                        files: OptionFiles) -> str:
  """A stream dataset's fingerprint: its records' and every stream key, even
  when only its pipeline makes it a stream (a 1:1 dataset's cursors do not
  fit a stream dataset of the same name)."""
  base = fingerprint(config, opened.num_records, opened.identities, files)
  return contract.stream_fingerprint({
      "records": base, "stream": True, "iter_pipeline": config.iter_pipeline,
      "batch_fn": config.batch_fn, "iter_options": config.iter_options})


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
    """Any G the contract allows is served (ServedDataset)."""
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
    None for shards on local disk (ServedDataset)."""
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


class Datasets:
  """A config's datasets by name, each opened once: every one at start-up
  (a server: a bad dataset stops it before it serves), or each on first use
  (embedded mode opens only what the trainer reads).

  `identities`: the shards' and option files' identities the supervisor
  recorded when the server started (`record_identities`), the same for
  every worker however late it starts; None records each dataset's when it
  is opened. A dataset whose files are not as recorded when it is opened
  (a worker restarted after a tokenizer was replaced) is refused, on every
  request for it, with the ShardChangedError that names the file; the
  others are served.
  """

  def __init__(self, config: ServerConfig, *, open_now: bool = True,
               identities: Recorded | None = None):
    self.config = config
    self._recorded = identities
    # Guarded by _lock: the datasets opened, mixtures' components, and the
    # datasets refused (name -> the ShardChangedError's message).
    self._opened: dict[str, ServedDataset] = {}
    self._forever: dict[str, ElevatorDataset] = {}
    self._refused: dict[str, str] = {}
    self._lock = threading.Lock()
    if open_now:
      for name in config.datasets:
        try:
          self.get(name)
        except ShardChangedError:
          pass  # refused, and logged once

  @property
  def names(self) -> list[str]:
    return sorted(self.config.datasets)

  @property
  def num_shards(self) -> int:
    """Distinct shard files of the datasets opened (each may hold descriptors)."""
    with self._lock:
      opened = [*self._opened.values(), *self._forever.values()]
    return len({f for ds in opened for f in getattr(ds, "identities", {})})

  def opened(self) -> dict[str, ServedDataset]:
    """The datasets opened so far and served, by name (not those refused)."""
    with self._lock:
      return dict(self._opened)

  def get(self, name: str) -> ServedDataset:
    """The opened dataset; UnknownDatasetError (NOT_FOUND) naming what
    exists; ShardChangedError (FAILED_PRECONDITION) for one refused."""
    with self._lock:
      return self._get_unlocked(name)

  def _get_unlocked(self, name: str) -> ServedDataset:
    """`get`, with the lock held (a stream's source opens its mixture)."""
    ds = self._opened.get(name)
    if ds is not None:
      return ds
    if name in self._refused:
      raise ShardChangedError(self._refused[name])  # a new one: no traceback piles up
    dataset_config = self.config.datasets.get(name)
    if dataset_config is None:
      raise UnknownDatasetError(
          f"unknown dataset {name!r}; this server offers: "
          f"{', '.join(self.names) or '(none)'}")
    try:
      ds = self._checked(dataset_config, lambda files: open_dataset(
          dataset_config, self._shards, files, self._open_forever, self._get_unlocked))
    except ShardChangedError as e:
      self._refused[name] = str(e)
      log.error("dataset %r is refused: %s", name, e)
      raise
    self._opened[name] = ds
    return ds

  @property
  def _shards(self) -> Mapping[str, ShardIdentity] | None:
    return None if self._recorded is None else self._recorded.shards

  def _checked(self, config: DatasetConfig,
               open_with: Callable[[OptionFiles], ServedDataset]) -> ServedDataset:
    """`open_with(files)`, with the files `config`'s options name checked
    against their recording before (nothing has read them yet) and after
    (its pipelines were built and made their first record or batch, so
    what they read is what the fingerprint covers)."""
    files = OptionFiles(config, None if self._recorded is None else self._recorded.files)
    files.check()
    ds = open_with(files)
    files.check()
    return ds

  def _open_forever(self, name: str) -> ElevatorDataset:
    """A mixture's component: its own stream, repeated forever."""
    ds = self._forever.get(name)
    if ds is None:
      config = dataclasses.replace(self.config.datasets[name], num_epochs=0,
                                   drop_remainder=True)
      ds = self._forever[name] = self._checked(config, lambda files: ElevatorDataset(
          config, self._shards, files=files))
    return ds
