"""Embedded mode: the server's own dataset code, run in the trainer's process.

Same contract, same batch assembly, no network: bit-identical to the service,
which makes it both the zero-set-up path and the tests' oracle.
"""

from __future__ import annotations

import threading

import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server import config as config_lib
from grain_elevator.server import dataset as dataset_lib
from grain_elevator.server.errors import UnknownDatasetError


class EmbeddedBackend:
  """Serves a config's datasets in-process, opening each on first use."""

  def __init__(self, config_path: str):
    self.config_path = config_path
    self.targets = [f"local:{config_path}"]
    self._config = config_lib.load_config(config_path)
    self._datasets: dict[str, dataset_lib.ElevatorDataset] = {}
    self._lock = threading.Lock()

  def dataset(self, name: str) -> dataset_lib.ElevatorDataset:
    with self._lock:
      if name not in self._datasets:
        if name not in self._config.datasets:
          raise UnknownDatasetError(
              f"unknown dataset {name!r}; {self.config_path} offers: "
              f"{', '.join(sorted(self._config.datasets))}")
        self._datasets[name] = dataset_lib.ElevatorDataset(self._config.datasets[name])
      return self._datasets[name]

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    del global_batch_size  # DatasetInfo computes steps for any G.
    names = [dataset] if dataset else sorted(self._config.datasets)
    return [self.dataset(n).info for n in names]

  def fetch(self, request: pb.BatchRequest, token: object = None,
            out: list[list[np.ndarray]] | None = None) -> list[list[np.ndarray]]:
    """Like ConnectionPool.fetch: steps appended to `out` as they are made."""
    del token  # In-process work is not interruptible mid-batch.
    r = request
    ds = self.dataset(r.dataset)
    ds.check_request(r.global_batch_size, r.shard_index, r.shard_count,
                     r.start_step, r.num_steps, r.config_fingerprint)
    out = [] if out is None else out
    for s in range(r.start_step, r.start_step + r.num_steps):
      out.append(ds.host_batch_leaves(s, r.global_batch_size, r.shard_index, r.shard_count))
    return out

  def close(self) -> None:
    pass
