"""A config's datasets by name, each opened once as one of
two kinds (factory.py's `Dataset`: a StepDataset or a StreamDataset), and
the datasets refused because their files changed since start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Mapping, TypeVar

from grain_elevator.proto.errors import ShardChangedError, UnknownDatasetError
from grain_elevator.server.data.config import DatasetConfig, ServerConfig
from grain_elevator.server.data.elevator_dataset import ElevatorDataset
from grain_elevator.server.data.registry.factory import Dataset, open_dataset
from grain_elevator.server.data.shards.identity import Recorded, ShardIdentity
from grain_elevator.server.data.shards.option_files import OptionFiles

log = logging.getLogger("grain_elevator.server")

_Opened = TypeVar("_Opened")


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
    self._opened: dict[str, Dataset] = {}
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

  def opened(self) -> dict[str, Dataset]:
    """The datasets opened so far and served, by name (not those refused)."""
    with self._lock:
      return dict(self._opened)

  def get(self, name: str) -> Dataset:
    """The opened dataset; UnknownDatasetError (NOT_FOUND) naming what
    exists; ShardChangedError (FAILED_PRECONDITION) for one refused."""
    with self._lock:
      return self._get_unlocked(name)

  def _get_unlocked(self, name: str) -> Dataset:
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
               open_with: Callable[[OptionFiles], _Opened]) -> _Opened:
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
