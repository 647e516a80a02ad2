"""Replicas and workers die or freeze mid-stream; the trainer still receives
every step exactly once, in order, equal to the oracle."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from grain_elevator.client import (RemoteDataset, RetryPolicy, ServiceUnavailableError,
                                   TransportOptions)
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import oracle_batch, wait_for_log, worker_pids

pytestmark = pytest.mark.slow

G = 8  # aug2: 2 epochs x 1000 records -> 250 steps


def _kill_replica(server: LocalServer) -> None:
  """SIGKILL the supervisor and its workers: the replica vanishes at once."""
  workers = worker_pids(server)
  os.kill(server.proc.pid, signal.SIGKILL)
  for pid in workers:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  server.proc.wait()


@pytest.fixture(scope="module")
def expected_ids(oracle) -> list[np.ndarray]:
  return [oracle_batch(oracle, "aug2", k, G)["id"] for k in range(250)]


def _consume(ds: RemoteDataset, expected: list[np.ndarray], at: int, fault) -> None:
  got = []
  for k, batch in enumerate(ds):
    got.append(batch["id"])
    if k == at:
      fault()
  assert len(got) == len(expected), f"received {len(got)} steps, expected {len(expected)}"
  for k, (a, b) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(a, b, err_msg=f"step {k}")


@pytest.mark.parametrize("seed, transport", [(1, "grpc"), (2, "bulk")])
def test_sigkill_one_of_two_replicas(config_path, expected_ids, seed, transport):
  at = random.Random(seed).randrange(20, 200)
  a, b = LocalServer(config_path, workers=1), LocalServer(config_path, workers=1)
  try:
    with RemoteDataset([a.target, b.target], "aug2", G, prefetch=6,
                       retry=RetryPolicy(timeout_s=30),
                       transport=TransportOptions(kind=transport)) as ds:
      _consume(ds, expected_ids, at, lambda: _kill_replica(a))
  finally:
    a.stop()
    b.stop()


def test_sigkill_one_worker_of_a_replica(config_path, expected_ids):
  at = random.Random(3).randrange(20, 200)
  with LocalServer(config_path, workers=2) as server:
    victim = worker_pids(server)[0]
    with RemoteDataset(server.target, "aug2", G, prefetch=6,
                       retry=RetryPolicy(timeout_s=30)) as ds:
      _consume(ds, expected_ids, at, lambda: os.kill(victim, signal.SIGKILL))
    wait_for_log(server, "killed by signal SIGKILL")


def test_sigstop_replica_is_treated_as_failed_after_the_deadline(config_path, expected_ids):
  at = random.Random(4).randrange(20, 200)
  a, b = LocalServer(config_path, workers=1), LocalServer(config_path, workers=1)
  frozen = worker_pids(a)
  try:
    def freeze():
      for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    with RemoteDataset([a.target, b.target], "aug2", G, prefetch=6,
                       retry=RetryPolicy(timeout_s=60, request_timeout_s=1.5)) as ds:
      _consume(ds, expected_ids, at, freeze)
  finally:
    for pid in frozen:
      os.kill(pid, signal.SIGCONT)
    a.stop()
    b.stop()


def test_all_replicas_down_then_one_returns_within_the_retry_window(config_path,
                                                                   expected_ids):
  at = random.Random(5).randrange(20, 200)
  first = LocalServer(config_path, workers=1)
  port = first.port
  replacement: list[LocalServer] = []

  def outage():
    _kill_replica(first)
    time.sleep(2.0)  # nobody is serving now
    replacement.append(LocalServer(config_path, workers=1, port=port))

  try:
    with RemoteDataset(first.target, "aug2", G, prefetch=4,
                       retry=RetryPolicy(timeout_s=60)) as ds:
      _consume(ds, expected_ids, at, outage)
  finally:
    for s in replacement:
      s.stop()


def test_all_replicas_down_for_good_gives_one_clear_error(config_path):
  server = LocalServer(config_path, workers=1)
  ds = RemoteDataset(server.target, "aug2", G, prefetch=2, retry=RetryPolicy(timeout_s=2))
  it = iter(ds)
  next(it)
  _kill_replica(server)
  with pytest.raises(ServiceUnavailableError,
                     match=rf"no replica of {server.target} could serve dataset 'aug2' step \d+"):
    for _ in range(300):
      next(it)
  ds.close()
