"""A dataset's record stream, as the contract states it (docs/concepts.md):
its source opened through its shards' recorded identities, seeded,
shuffled and repeated with Grain's own `seed().shuffle().repeat()`, its
pipeline applied; its fingerprint; and where each record came from.

Every kind of dataset is built on it: a 1:1 dataset (elevator_dataset.py),
a stream dataset (streams/stream.py, opened by registry/factory.py), a mixture's
components. The fingerprint covers each shard's identity, recorded when the
server started, and shards are read only while they still have it
(server/data/shards/identity.py); likewise the files its options name
(server/data/shards/option_files.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import grain

from grain_elevator import pipelines

from grain_elevator.proto import contract
from grain_elevator.proto.errors import ConfigError, ShardChangedError
from grain_elevator.server.data import grain_private
from grain_elevator.server.data.config import DatasetConfig
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.shards import reader as shard_reader
from grain_elevator.server.data.shards.identity import (ObjectIdentity, ShardIdentity,
                                                        shard_identities)
from grain_elevator.server.data.shards.option_files import OptionFiles
from grain_elevator.server.data.storage import urls


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
  number of records (a stream dataset's may: server/data/streams/stream.py)."""
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




def is_stream_pipeline(records: grain.MapDataset, head: grain.MapDataset) -> bool:
  """Whether `head` (a pipeline applied to `records`) is not 1:1: it changes
  the length (flat_map) or holds a filter between the two."""
  if len(head) != len(records):
    return True
  seen, todo = set(), [head]
  while todo:
    node = todo.pop()
    if node is records or id(node) in seen:
      continue
    seen.add(id(node))
    if "Filter" in type(node).__name__ or "FlatMap" in type(node).__name__:
      return True
    todo.extend(p for p in getattr(node, "parents", ()) if isinstance(p, grain.MapDataset))
  return False


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
