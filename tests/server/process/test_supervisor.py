"""Worker supervision: restart backoff, crash loops, and no worker outliving
its supervisor, however soon after a restart that supervisor dies."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import psutil
import pytest

from grain_elevator.server.process import restarts
from grain_elevator.server.serving import grpc_service
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import worker_pids
import datasets

pytestmark = pytest.mark.slow  # workers, fork servers, supervisors killed

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MIN, MAX = restarts.RESTART_DELAY_MIN_S, restarts.RESTART_DELAY_MAX_S
STABLE = restarts.RESTART_STABLE_AFTER_S


# -- the restart policy, on a made-up clock ------------------------------------

@pytest.mark.parametrize("uptimes, delays", [
    # Quick deaths double the delay up to the cap.
    ([0, 0, 0, 0], [MIN, 2 * MIN, 4 * MIN, 8 * MIN]),
    ([1] * 10, [min(MIN * 2**k, MAX) for k in range(10)]),
    # A worker up long enough starts its slot over; one just short does not.
    ([0, 0, STABLE, 0], [MIN, 2 * MIN, MIN, 2 * MIN]),
    ([0, 0, STABLE - 1, 0], [MIN, 2 * MIN, 4 * MIN, 8 * MIN]),
])
def test_backoff(uptimes, delays):
  history, now = restarts.SlotHistory(), 100.0
  got = []
  for up in uptimes:
    history.started(now)
    now += up
    got.append(history.died(now))
    now += got[-1]
  assert got == delays


def test_a_crash_loop_starts_after_k_quick_deaths_and_ends_once_stable():
  history, now = restarts.SlotHistory(), 0.0
  for _ in range(restarts.CRASH_LOOP_RESTARTS + 1):
    assert not history.crash_loop
    history.started(now)
    now += history.died(now + 1) + 1
  assert history.crash_loop and history.deaths == restarts.CRASH_LOOP_RESTARTS + 1
  # It lasts through a long backoff, and while the next worker is still young.
  now += 10 * STABLE
  history.started(now)
  assert not history.stable(now + STABLE - 1) and history.crash_loop
  assert history.stable(now + STABLE)
  assert not history.crash_loop and history.delay_s == MIN and history.deaths == 0
  assert not history.stable(now + STABLE + 1)  # reported once


def test_workers_see_the_crash_loop_flag_change():
  flag = restarts.CrashLoopFlag(mp.get_context("spawn"))
  seen: list[bool] = []
  stop = threading.Event()
  flag.watch(seen.append, stop)
  assert seen == []  # not looping: nothing to change from SERVING
  flag.set(2)
  assert _wait_for(lambda: seen == [True], 60), seen
  flag.set(0)
  assert _wait_for(lambda: seen == [True, False], 60), seen
  stop.set()
  flag.set(1)
  later = threading.Event()
  flag.watch(seen.append, later)
  later.set()
  assert seen[-1] is True  # a worker started during a loop reports it at once


# -- real servers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def one_dataset(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> str:
  """A config of one raw dataset: workers start fast, restarts are cheap."""
  return datasets.write_config(tmp_path_factory.mktemp("supervisor") / "elevator.toml",
                               raw=datasets.raw(data_dir / datasets.SHARDS))


def _wait_for(predicate: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(every)
  return predicate()


def _alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _restarted(server: LocalServer, known: set[int], timeout: float = 60.0) -> int:
  """The pid of a worker not in `known`, once it has named itself (after its
  tie to the supervisor: lifeline.py)."""
  found: list[int] = []

  def new_worker() -> bool:
    found.extend(set(worker_pids(server)) - known)
    return bool(found)
  assert _wait_for(new_worker, timeout, every=0.005), server.stderr()
  return found[0]


def _logged_at(log: str, text: str) -> float:
  """When the first log line holding `text` was written (its timestamp)."""
  (line,) = [l for l in log.splitlines() if text in l][:1]
  stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
  return stamp.timestamp()


def _listening(port: int) -> bool:
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
      return True
  except OSError:
    return False


def _listens(pid: int, port: int) -> bool:
  try:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections("tcp"))
  except psutil.NoSuchProcess:
    return False


def _health(target: str, service: str = "") -> int:
  # A channel of its own, not one from gRPC's shared subchannel pool: a fresh
  # connection, so whichever worker the kernel picks now answers.
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=30).status


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.1, 0.2, 0.4, 0.8])
def test_a_supervisor_killed_just_after_a_restart_leaves_no_worker(one_dataset, after_s):
  """The restarted worker is still starting (imports, datasets) when its
  supervisor dies: it must exit, not finish starting as an orphan."""
  server = LocalServer(one_dataset, workers=1)
  family: list[int] = []
  try:
    (first,) = worker_pids(server)
    os.kill(first, signal.SIGKILL)
    _restarted(server, {first})
    time.sleep(after_s)
    family = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
    server.proc.kill()
    server.proc.wait(10)
    assert _wait_for(lambda: not any(map(_alive, family)), 60), (
        f"left running: {[p for p in family if _alive(p)]}\n{server.stderr()}")
    assert not _listening(server.port)
  finally:
    for pid in family:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    server.stop()


def test_a_crash_loop_backs_off_is_logged_and_fails_health(one_dataset):
  """One worker of two is SIGKILLed each time it comes back: its restarts
  wait longer each time, the loop is logged at ERROR and every worker's
  health says NOT_SERVING; SIGTERM still stops the server mid-backoff."""
  loop = restarts.CRASH_LOOP_RESTARTS + 1  # the death that makes it a loop
  with LocalServer(one_dataset, workers=2) as server:
    assert _health(server.target) == SERVING
    victim, other = worker_pids(server)
    gaps = []
    for _ in range(loop):
      os.kill(victim, signal.SIGKILL)
      killed = time.monotonic()
      victim = _restarted(server, {victim, other})
      gaps.append(time.monotonic() - killed)
    # Announced and measured delays, kill k -> restart k: 0.5, 1, 2, 4 s. Each
    # restart waited at least its delay; how much longer is the machine's
    # speed (spawning a process under load), so gaps are not compared.
    restarting = r"restarting it in ([\d.]+)s"
    assert _wait_for(lambda: len(re.findall(restarting, server.stderr())) == loop, 60), (
        server.stderr())
    announced = [float(s) for s in re.findall(restarting, server.stderr())]
    assert announced == [MIN * 2**k for k in range(loop)], server.stderr()
    assert all(g >= a for g, a in zip(gaps, announced)), (gaps, announced)
    error = (rf" ERROR worker \d \(pid \d+\) killed by signal SIGKILL; restarting it in "
             rf"{MIN * 2**(loop - 1):.1f}s; crash loop: died {loop} times in a row")
    assert re.search(error, server.stderr()), server.stderr()
    assert f"crash loop: died {loop - 1} " not in server.stderr()  # not before
    for service in ("", grpc_service.SERVICE_NAME):
      assert _wait_for(lambda: _health(server.target, service) == NOT_SERVING, 60)
      assert _health(server.health_target, service) == NOT_SERVING  # the health port too
    # Both workers, the restarted one too: once it listens, probes (the kernel
    # picks a worker for each) all say NOT_SERVING.
    assert _wait_for(lambda: _listens(victim, server.port), 120), server.stderr()
    assert _wait_for(
        lambda: [_health(server.target) for _ in range(8)] == [NOT_SERVING] * 8, 60)

    next_delay = MIN * 2**loop
    os.kill(victim, signal.SIGKILL)  # the next restart waits 8 s
    restarting = f"restarting it in {next_delay:.1f}s"
    assert _wait_for(lambda: restarting in server.stderr(), 60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.stderr()
    # Stopped mid-backoff: the other worker was told to stop before the restart
    # was due, by the log's own clock (how long the processes then take to
    # exit is the machine's speed, seconds on a loaded one).
    log = server.stderr()
    assert _logged_at(log, restarting) + next_delay > _logged_at(log, "stopping: "), log


def _fork_server(server: LocalServer) -> psutil.Process:
  """The fork server of a LocalServer: its child that forks the workers."""
  (fork_server,) = [p for p in psutil.Process(server.proc.pid).children()
                    if any(c.name().startswith("elevator-w") for c in p.children())]
  return fork_server


def test_a_sigterm_to_every_process_of_the_server_stops_it_cleanly(one_dataset):
  """As systemd stops a unit (and `pkill` matches them all): the fork server
  ignores SIGTERM, so no live worker is taken for dead and restarted while
  the server stops."""
  server = LocalServer(one_dataset, workers=2)
  try:
    family = [server.proc.pid, _fork_server(server).pid, *worker_pids(server)]
    for pid in family:
      os.kill(pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.stderr()
    assert _wait_for(lambda: not any(map(_alive, family)), 60), (
        f"left running: {[p for p in family if _alive(p)]}")
    assert "restarting it" not in server.stderr(), server.stderr()
  finally:
    server.stop()


def test_a_fork_server_killed_leaves_no_worker_twice_in_its_slot(one_dataset):
  """SIGKILLed (the OOM killer), the fork server takes its workers' exit
  statuses with it: the supervisor kills the workers it can no longer
  watch, and restarts them through a new fork server."""
  with LocalServer(one_dataset, workers=1) as server:
    (first,) = worker_pids(server)
    old = _fork_server(server)
    old.kill()
    assert _wait_for(lambda: "is serving again" in server.stderr(), 60), server.stderr()
    assert "lost its fork server, and was killed" in server.stderr()
    assert _wait_for(lambda: not _alive(first), 60)
    (second,) = worker_pids(server)
    assert second != first and _fork_server(server).pid != old.pid
    assert _health(server.target) == SERVING


_FORKS_THEN_WAITS = """
import os, sys, threading
from grain_elevator.server import Server, ServerOptions
if __name__ == "__main__":
  server = Server(sys.argv[1], ServerOptions(port=0, workers=1))
  server.start()
  child = os.fork()  # holds every descriptor of the server, its pipes too
  if child == 0:
    threading.Event().wait()
  print(child, *server.worker_pids(), flush=True)
  threading.Event().wait()
"""


def test_workers_outlive_no_supervisor_whose_fork_holds_their_pipes(one_dataset, tmp_path):
  """A program serving through the Server API forks (a fork-start
  multiprocessing pool): its child holds the pipes that tell a worker its
  supervisor lives. SIGKILLed, the supervisor still takes its workers with it."""
  script = tmp_path / "forks.py"
  script.write_text(_FORKS_THEN_WAITS)
  proc = subprocess.Popen([sys.executable, str(script), one_dataset], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  child, *workers = [int(p) for p in proc.stdout.readline().split()]
  try:
    assert workers and all(map(_alive, workers))
    proc.kill()
    proc.wait(30)
    assert _wait_for(lambda: not any(map(_alive, workers)), 60), (
        f"left running: {[p for p in workers if _alive(p)]}")
  finally:
    for pid in [child, *workers]:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    proc.kill()
