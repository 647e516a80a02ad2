"""A stream dataset split into N sub-streams, made apart: one global batch
that N servers can pack at once.

One stream (stream.py) is sequential past its head: a packer's rows depend
on every element before them, so one process owns it and its rate is one
machine's. A config's `stream_shards = N` splits it by records, not by
hosts, so that the batches never depend on who serves them:

    sub-stream j    = the stream's pipeline over records[j::N] (its own
                      head, iter_pipeline and batches of G/N rows)
    global batch k  = sub-batch k of sub-streams 0 .. N-1, one after another
    host h of H     = rows [h*G/H, (h+1)*G/H) of that, as for any dataset

Each sub-stream is a `StreamDataset` of its own, with its own positions: a
request reads one (BatchRequest.stream_shard) and continues from its
position, so the client can send sub-stream j to a server chosen from j and
N sub-streams keep N servers busy. A row depends on the config and G alone
(N is the config's); G may change to another multiple of N, each
sub-stream continuing from its position with the new G/N.

Evaluation mode (drop_remainder = false): each sub-stream pads its own last
batch and masks it; a global batch goes on while any sub-stream has one,
the sub-streams that ended giving G/N padding rows. Training mode ends with
the first sub-stream that ends (a global batch needs every sub-batch whole).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import grain
import numpy as np

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.config import DatasetConfig
from grain_elevator.server.data.streams.stream import StreamDataset, StreamRecords


def part_records(records: StreamRecords, shard: int, shards: int) -> StreamRecords:
  """Sub-stream `shard`'s records: every `shards`-th of `records`, from the
  `shard`-th, with what is known of each (its origin, source, reads)
  mapped from its position here to its position in the whole stream."""
  whole = lambda positions: [shard + shards * int(p) for p in positions]
  origins, component_of, needs = records.origins, records.component_of, records.needs
  return dataclasses.replace(
      records, records=records.records[shard::shards],
      fingerprint=part_fingerprint(records.fingerprint, shard, shards),
      origins=None if origins is None else lambda positions: origins(whole(positions)),
      component_of=None if component_of is None else lambda positions: component_of(
          shard + shards * np.asarray(positions, np.int64)),
      needs=None if needs is None else lambda positions: needs(whole(positions)))


def part_fingerprint(fingerprint: str, shard: int, shards: int) -> str:
  """A sub-stream's fingerprint: its sessions, cached batches and head tasks
  are its own, never another sub-stream's."""
  return f"{fingerprint}/{shard}of{shards}"


class SubStreams:
  """A registered stream dataset of N > 1 sub-streams (module docstring):
  its info (DatasetInfo.stream_shards, stream_starts) and its parts."""

  def __init__(self, config: DatasetConfig, records: StreamRecords,
               head_of: Callable[[grain.MapDataset], grain.MapDataset],
               check_files: Callable[[], None] | None = None):
    """`head_of`: the config's pipeline over a sub-stream's records."""
    n = config.stream_shards
    self.config = config
    self.parts: list[StreamDataset] = []
    for j in range(n):
      mine = part_records(records, j, n)
      try:
        self.parts.append(StreamDataset(config, mine, head_of(mine.records),
                                        check_files=check_files))
      except ConfigError as e:
        raise ConfigError(f"sub-stream {j} of {n}: {e}") from e
    first = self.parts[0].info
    for j, part in enumerate(self.parts[1:], 1):
      if part.info.element_spec != first.element_spec:
        raise ConfigError(
            f"dataset {config.name!r}: sub-stream {j} of {n} has rows "
            f"{part.info.element_spec.leaves}, sub-stream 0 {first.element_spec.leaves}: "
            "every sub-stream must pack to the same row shapes")
    self.info = dataclasses.replace(
        first, config_fingerprint=records.fingerprint, stream_shards=n,
        stream_starts=tuple(p.info.stream_start for p in self.parts))
    # What is known of its records, for the registry (its shards' identities).
    self.identities = records.identities

  def part(self, shard: int) -> StreamDataset:
    return self.parts[shard]
