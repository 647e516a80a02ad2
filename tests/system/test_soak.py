"""Soak: four concurrent clients (different datasets, G and H) while workers
are killed at random; every stream equals its oracle, memory stays bounded."""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time

import numpy as np
import psutil
import pytest

from grain_elevator.client import RemoteDataset, RetryPolicy
from grain_elevator.tools.launcher import LocalServer
from helpers import oracle_batch, worker_pids

pytestmark = pytest.mark.slow

CLIENTS = [  # dataset, G, h, H, steps
    ("aug2", 4, 0, 1, 500),
    ("seed3", 4, 1, 2, 250),
    ("plain", 2, 1, 2, 500),
    ("forever", 8, 2, 4, 600),
]
MAX_KILLS = 4


def test_four_clients_while_workers_die(config_path, oracle):
  rng = random.Random(7)
  results: dict[str, list[np.ndarray]] = {}
  errors: list[BaseException] = []
  with LocalServer(config_path, workers=2) as server:
    def consume(dataset, g, h, n, steps):
      try:
        with RemoteDataset(server.target, dataset, g, shard_index=h, shard_count=n,
                           prefetch=4, retry=RetryPolicy(timeout_s=60)) as ds:
          results[dataset] = [b["id"] for b in itertools.islice(iter(ds), steps)]
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)

    threads = [threading.Thread(target=consume, args=c) for c in CLIENTS]
    for t in threads:
      t.start()
    kills, peak_rss = 0, 0
    deadline = time.monotonic() + 240
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
      time.sleep(rng.uniform(0.3, 1.0))
      workers = worker_pids(server)
      peak_rss = max(peak_rss, sum(psutil.Process(p).memory_info().rss for p in workers
                                   if psutil.pid_exists(p)))
      restarted = server.stderr().count("restarting it") == kills
      if kills < MAX_KILLS and len(workers) == 2 and restarted:
        os.kill(rng.choice(workers), signal.SIGKILL)
        kills += 1
    for t in threads:
      t.join(60)
    assert not errors, errors
    assert kills >= 2, f"only {kills} kill(s) before the clients finished"
    for _ in range(300):  # the last restart may still be logging
      if server.stderr().count("restarting it") == kills:
        break
      time.sleep(0.1)
    assert server.stderr().count("restarting it") == kills
  for dataset, g, h, n, steps in CLIENTS:
    got = results[dataset]
    assert len(got) == steps, dataset
    for k, ids in enumerate(got):
      np.testing.assert_array_equal(ids, oracle_batch(oracle, dataset, k, g, h, n)["id"],
                                    err_msg=f"{dataset} step {k}")
  # Two workers over 4 small datasets: far below a GiB whatever was killed.
  assert peak_rss < 2 << 30, f"workers used {peak_rss / 2**20:.0f} MiB"
