"""The factory: a registered dataset opened as the request path serves it,
as one of two kinds (`Dataset`).

A step dataset (step_dataset.py: a 1:1 dataset whose steps map to records
in O(1), elevator_dataset.py, or a mixture of them, mixture.py), or a
stream dataset (streams/stream.py: a pipeline that is not 1:1, one the
config makes so, or one over a mixture's records; split into sub-streams
by streams/sub_streams.py), each built from its config and the records
records.py opens.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

from grain_elevator.proto import contract
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import provenance
from grain_elevator.server.data import shuffle as shuffle_lib
from grain_elevator.server.data.config import DatasetConfig
from grain_elevator.server.data.elevator_dataset import ElevatorDataset
from grain_elevator.server.data.records import (OpenedSource, apply_pipeline, build_raw_records,
                                                fingerprint, is_stream_pipeline, record_origins)
from grain_elevator.server.data.shards.identity import ShardIdentity
from grain_elevator.server.data.shards.option_files import OptionFiles
from grain_elevator.server.data.step_dataset import StepDataset
from grain_elevator.server.data.streams.stream import StreamDataset, StreamRecords
from grain_elevator.server.data.streams.sub_streams import SubStreams

# What the registry holds, and the request path serves, each by its shape
# (server/serving/request_path.py): one of the two kinds, named once.
Dataset = StepDataset | StreamDataset | SubStreams


def open_dataset(config: DatasetConfig,
                 identities: Mapping[str, ShardIdentity | None] | None,
                 files: OptionFiles,
                 open_forever: Callable[[str], ElevatorDataset],
                 open_named: Callable[[str], Dataset]) -> Dataset:
  """A registered dataset as the request path serves it: a mixture, a
  stream dataset (a pipeline that is not 1:1, or one the config makes so),
  or a dataset whose steps map to records in O(1). `files`: those its
  options name, checked by the caller before and after."""
  if config.schedule is not None:
    from grain_elevator.server.data.mixture import MixtureDataset  # pylint: disable=g-import-not-at-top
    return MixtureDataset(config, open_forever)
  if config.source is not None:  # a mixture's records, mixed by Grain itself
    mixture = open_named(config.source)
    records = mixture.fixed_records()
    fields = {"option_files": files.fingerprint_fields()} if files.files else {}
    return _stream(config, StreamRecords(
        records, num_records=mixture.info.num_records,
        fingerprint=contract.stream_fingerprint({
            **fields,
            "name": config.name, "source": mixture.info.config_fingerprint,
            "pipeline": config.pipeline, "options": config.options,
            "drop_remainder": config.drop_remainder,
            "iter_pipeline": config.iter_pipeline,
            "batch_fn": config.batch_fn,
            "iter_options": config.iter_options, **_shards_field(config)}),
        origins=functools.partial(provenance.mixture_origins, mixture, global_batch_size=1),
        component_names=tuple(mixture.names),
        component_of=lambda positions: mixture.locate(positions, 1)[0]),
        _iter_files_check(files))
  opened = OpenedSource.open(config, identities)
  head = apply_pipeline(config, opened.raw_records, one_to_one=False)
  if config.names_a_stream or is_stream_pipeline(opened.raw_records, head):
    if config.batch_transform is not None:
      raise ConfigError(
          f"dataset {config.name!r}: its pipeline filters or flat-maps, so it is a stream "
          "dataset, and 'batch_transform' (a whole-batch decode of a 1:1 pipeline) cannot "
          "apply; give a 'batch_fn' instead")
    index = shuffle_lib.SourceIndexMap(build_raw_records(config, range(opened.num_records)),
                                       opened.num_records)
    needs = getattr(opened.source, "needs", None)  # in a bucket
    records = StreamRecords(
        opened.raw_records, num_records=opened.num_records,
        fingerprint=_stream_fingerprint(config, opened, files),
        identities=opened.identities,
        origins=functools.partial(record_origins, opened.source, index),
        needs=None if needs is None else lambda positions: needs(index(positions)))
    if config.stream_shards == 1:  # the head built above, whose length decided the kind
      return StreamDataset(config, records, head, check_files=_iter_files_check(files))
    return _stream(config, records, _iter_files_check(files))
  return ElevatorDataset(config, identities, opened=opened, records=head, files=files)


def _stream(config: DatasetConfig, records: StreamRecords,
            check_files: Callable[[], None] | None) -> StreamDataset | SubStreams:
  """A stream dataset over `records`: one stream, or the config's
  `stream_shards` sub-streams, each the pipeline over its own records."""
  head_of = lambda ds: apply_pipeline(config, ds, one_to_one=False)
  if config.stream_shards == 1:
    return StreamDataset(config, records, head_of(records.records), check_files=check_files)
  return SubStreams(config, records, head_of, check_files)


def _shards_field(config: DatasetConfig) -> dict[str, int]:
  """What sub-streams add to a stream's fingerprint: nothing for one stream
  (its cursors stay valid), N for N > 1 (every row depends on it)."""
  return {"stream_shards": config.stream_shards} if config.stream_shards > 1 else {}


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
      "batch_fn": config.batch_fn, "iter_options": config.iter_options,
      **_shards_field(config)})
