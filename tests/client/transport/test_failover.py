"""Replicas and workers die or freeze mid-stream; the trainer still receives
every step exactly once, in order, equal to the oracle.

A replica SIGKILLed whole (supervisor and workers at once) is an `elevator
serve` process (LocalServer): this process cannot be killed. Every other
replica is an in-process Server (~0.4 s to start, against ~5 s): one whose
workers are frozen or killed, one that goes away (`stop` with no grace: its
requests end at once) and one started again on the same port."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Callable

import numpy as np
import pytest

from grain_elevator.client import (RemoteDataset, RetryPolicy, ServiceUnavailableError,
                                   TransportOptions)
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import oracle_batch, wait_for, worker_pids

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


def _replica(config_path: str, **options) -> Server:
  """A private in-process replica of one worker (not started) that, stopped,
  is gone at once: no grace for its requests in flight, as for a killed one."""
  return Server(config_path, ServerOptions(**{"port": 0, "workers": 1, "grace_s": 0.0,
                                              **options}))


@pytest.fixture(scope="module")
def expected_ids(oracle) -> list[np.ndarray]:
  return [oracle_batch(oracle, "aug2", k, G)["id"] for k in range(250)]


def _consume(ds: RemoteDataset, expected: list[np.ndarray], at: int,
             fault: Callable[[], None]) -> None:
  """Reads the whole stream, calling `fault` after step `at`: every step
  arrives once, in order, and the fault was met (a request failed and was
  tried again), not slept through."""
  got = []
  it = iter(ds)
  for k, batch in enumerate(it):
    got.append(batch["id"])
    if k == at:
      fault()
  assert len(got) == len(expected), f"received {len(got)} steps, expected {len(expected)}"
  for k, (a, b) in enumerate(zip(got, expected)):
    np.testing.assert_array_equal(a, b, err_msg=f"step {k}")
  assert it.stats().retries >= 1, it.stats()


@pytest.mark.parametrize("seed, transport", [(1, "grpc"), (2, "bulk")])
def test_sigkill_one_of_two_replicas(config_path, serve, expected_ids, seed, transport):
  at = random.Random(seed).randrange(20, 200)
  a, b = LocalServer(config_path, workers=1), serve()
  try:
    with RemoteDataset([a.target, b.target], "aug2", G, prefetch=6,
                       retry=RetryPolicy(timeout_s=30),
                       transport=TransportOptions(kind=transport)) as ds:
      _consume(ds, expected_ids, at, lambda: _kill_replica(a))
  finally:
    a.stop()


def test_sigkill_one_worker_of_a_replica(config_path, expected_ids, grain_elevator_logs):
  at = random.Random(3).randrange(20, 200)
  with _replica(config_path, workers=2) as server:
    victim = server.worker_pids()[0]
    with RemoteDataset(server.target, "aug2", G, prefetch=6,
                       retry=RetryPolicy(timeout_s=30)) as ds:
      _consume(ds, expected_ids, at, lambda: os.kill(victim, signal.SIGKILL))
    # The supervisor (a thread of this process) says why the worker died.
    wait_for(lambda: f"(pid {victim}) killed by signal SIGKILL" in grain_elevator_logs.text,
             "the supervisor to log the worker's death")


def test_sigstop_replica_is_treated_as_failed_after_the_deadline(config_path, serve,
                                                                 expected_ids):
  at = random.Random(4).randrange(20, 200)
  with _replica(config_path) as a:
    frozen = a.worker_pids()
    try:
      def freeze():
        for pid in frozen:
          os.kill(pid, signal.SIGSTOP)
      with RemoteDataset([a.target, serve().target], "aug2", G, prefetch=6,
                         retry=RetryPolicy(timeout_s=60, request_timeout_s=1.5)) as ds:
        _consume(ds, expected_ids, at, freeze)
    finally:
      for pid in frozen:
        os.kill(pid, signal.SIGCONT)


def test_all_replicas_down_then_one_returns_within_the_retry_window(config_path,
                                                                   expected_ids):
  at = random.Random(5).randrange(20, 200)
  first = _replica(config_path).start()
  replacement: list[Server] = []

  def outage():
    first.stop()
    time.sleep(2.0)  # nobody is serving now
    replacement.append(_replica(config_path, port=first.port).start())

  try:
    with RemoteDataset(first.target, "aug2", G, prefetch=4,
                       retry=RetryPolicy(timeout_s=60)) as ds:
      _consume(ds, expected_ids, at, outage)
  finally:
    first.stop()
    for s in replacement:
      s.stop()


def test_all_replicas_down_for_good_gives_one_clear_error(config_path):
  server = _replica(config_path).start()
  ds = RemoteDataset(server.target, "aug2", G, prefetch=2, retry=RetryPolicy(timeout_s=2))
  try:
    it = iter(ds)
    next(it)
    server.stop()
    with pytest.raises(ServiceUnavailableError,
                       match=rf"no replica of {server.target} could serve dataset 'aug2' step \d+"):
      for _ in range(300):
        next(it)
  finally:
    ds.close()
    server.stop()
