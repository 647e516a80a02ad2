"""Soak: four concurrent clients (different datasets, G and H) while workers
are killed; every stream equals its oracle, memory stays bounded.

The kills are driven by progress, not by the clock: kill i comes when the
first client reaches the i-th milestone of its stream, each client waits at
that milestone until kill i has been made, and a kill waits until the worker
killed before it is serving again. So every run makes MAX_KILLS kills in the
middle of the clients' streams, however fast or slow the machine is.
"""

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
from grain_elevator.server import Server, ServerOptions
from helpers import oracle_batch

pytestmark = pytest.mark.slow

CLIENTS = [  # dataset, G, h, H, steps
    ("aug2", 4, 0, 1, 500),
    ("seed3", 4, 1, 2, 250),
    ("plain", 2, 1, 2, 500),
    ("forever", 8, 2, 4, 600),
]
MAX_KILLS = 4
# Bounds on waiting for an event, so that a hang fails the test with a reason.
_WAIT_S = 120.0


class KillGates:
  """Kill i is made once a client reaches its milestone i (the fraction
  (i+1)/(MAX_KILLS+1) of its steps); clients wait there until it is."""

  def __init__(self) -> None:
    self._cond = threading.Condition()
    self.reached = 0  # the most milestones any client has reached
    self.made = 0     # kills made
    self.done = 0     # clients finished (or failed)

  def milestones(self, steps: int) -> set[int]:
    return {steps * (i + 1) // (MAX_KILLS + 1) for i in range(MAX_KILLS)}

  def at_milestone(self, i: int) -> None:
    """Client side: milestone i reached; waits for kill i."""
    with self._cond:
      self.reached = max(self.reached, i + 1)
      self._cond.notify_all()
      assert self._cond.wait_for(lambda: self.made > i, _WAIT_S), f"kill {i} never came"

  def finished(self) -> None:
    with self._cond:
      self.done += 1
      self._cond.notify_all()

  def wait_reached(self, i: int) -> bool:
    """Server side: True once a client reached milestone i; False if every
    client ended first (one failed)."""
    with self._cond:
      self._cond.wait_for(lambda: self.reached > i or self.done == len(CLIENTS), _WAIT_S)
      return self.reached > i

  def killed(self) -> None:
    with self._cond:
      self.made += 1
      self._cond.notify_all()


def _wait_for(condition, what: str) -> None:
  deadline = time.monotonic() + _WAIT_S
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def _count(log: list[str], text: str) -> int:
  return sum(text in line for line in list(log))


def test_four_clients_while_workers_die(config_path, oracle, grain_elevator_logs):
  rng = random.Random(7)
  gates = KillGates()
  results: dict[str, list[np.ndarray]] = {}
  errors: list[BaseException] = []
  # In-process (it kills its own workers): its supervisor's log is read here.
  with Server(config_path, ServerOptions(port=0, workers=2)) as server:
    def consume(dataset, g, h, n, steps):
      try:
        milestones = sorted(gates.milestones(steps))
        with RemoteDataset(server.target, dataset, g, shard_index=h, shard_count=n,
                           prefetch=4, retry=RetryPolicy(timeout_s=60)) as ds:
          got = []
          for k, batch in enumerate(itertools.islice(iter(ds), steps)):
            if k in milestones:
              gates.at_milestone(milestones.index(k))
            got.append(batch["id"])
          results[dataset] = got
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
      finally:
        gates.finished()

    threads = [threading.Thread(target=consume, args=c) for c in CLIENTS]
    for t in threads:
      t.start()
    peak_rss = 0
    for i in range(MAX_KILLS):
      if not gates.wait_reached(i):
        break
      # The worker killed last is back (not merely spawned) before the next kill.
      _wait_for(lambda: _count(grain_elevator_logs.messages, "is serving again") == i
                and len(server.worker_pids()) == 2, f"worker restart {i}")
      workers = server.worker_pids()
      peak_rss = max(peak_rss, sum(psutil.Process(p).memory_info().rss for p in workers
                                   if psutil.pid_exists(p)))
      os.kill(rng.choice(workers), signal.SIGKILL)
      gates.killed()
    for t in threads:
      t.join(_WAIT_S)
    assert not errors, errors
    assert gates.made == MAX_KILLS
    _wait_for(lambda: _count(grain_elevator_logs.messages, "restarting it") == MAX_KILLS,
              "the last restart's log line")
  for dataset, g, h, n, steps in CLIENTS:
    got = results[dataset]
    assert len(got) == steps, dataset
    for k, ids in enumerate(got):
      np.testing.assert_array_equal(ids, oracle_batch(oracle, dataset, k, g, h, n)["id"],
                                    err_msg=f"{dataset} step {k}")
  # Two workers over 4 small datasets: far below a GiB whatever was killed.
  assert peak_rss < 2 << 30, f"workers used {peak_rss / 2**20:.0f} MiB"
