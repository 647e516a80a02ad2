"""Issue 44's workers' lifecycle findings: health with no worker alive (5),
a stopped fork server (11), out of descriptors at a restart (12), and the
step board that remembers a step that killed a worker (2)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import psutil
import pytest

from grain_elevator.server.process import step_board
from grain_elevator.server.process import supervisor
from grain_elevator.server.process.health_board import HealthBoard
from grain_elevator.server.serving import step_errors
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import wait_for, worker_pids
import datasets

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- in-process ------------------------------------------------------------------

def test_no_live_worker_is_not_serving():
  board = HealthBoard(mp.get_context("spawn"), 2)
  board.slot(0).beat()
  assert board.reasons() == []  # one of two serving: SERVING
  board.reset(0)  # both slots dead or restarting
  assert board.reasons() == ["no worker is serving"]


def test_a_posted_step_is_refused_and_an_ended_one_is_not_taken():
  board = step_board.StepBoard(mp.get_context("spawn"), 2, in_flight=2)
  w0, w1 = board.slot(0), board.slot(1)
  a, b = step_errors.key_of("dataset 'd', step 1"), step_errors.key_of("dataset 'd', step 2")
  ea, eb = w0.begin(a, "step 1"), w0.begin(b, "step 2")
  assert w0.begin(a, "step 1 again") is None  # entries full: made untracked
  w0.end(eb)
  assert [(k, t) for k, _, t in board.taken(0)] == [(a, "step 1")]
  assert board.taken(1) == [] and w1.failed(a) is None
  board.post(a, "worker 0 killed by signal SIGSEGV")
  assert w1.failed(a) == "worker 0 killed by signal SIGSEGV" and w1.failed(b) is None
  w0.end(ea)
  for k in range(step_board.MAX_FAILED_STEPS):  # the oldest is forgotten
    board.post(step_errors.key_of(str(k)), str(k))
  assert w1.failed(a) is None and w1.failed(step_errors.key_of("0")) == "0"


# -- real servers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def one_dataset(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> str:
  return datasets.write_config(tmp_path_factory.mktemp("lifecycle") / "elevator.toml",
                               raw=datasets.raw(data_dir / datasets.SHARDS))


def _health(target: str) -> int:
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                timeout=30).status


def _fork_server(server: LocalServer) -> psutil.Process:
  (fork_server,) = [p for p in psutil.Process(server.proc.pid).children()
                    if any(c.name().startswith("elevator-w") for c in p.children())]
  return fork_server


@pytest.mark.slow
def test_health_is_not_serving_while_no_worker_lives(one_dataset):
  """The fork server killed: its one worker is killed and restarted after
  at least RESTART_DELAY_MIN_S, a window in which no worker lives (2.7 s
  measured in the issue, all 30 probes SERVING before the fix)."""
  with LocalServer(one_dataset, workers=1) as server:
    assert _health(server.health_target) == SERVING
    _fork_server(server).kill()
    wait_for(lambda: _health(server.health_target) == NOT_SERVING,
             "NOT_SERVING with no worker alive", every_s=0.01)
    wait_for(lambda: _health(server.health_target) == SERVING, "SERVING once restarted")


@pytest.mark.slow
def test_a_stopped_fork_server_is_replaced_and_sigterm_still_stops(one_dataset):
  """SIGSTOPped, the fork server reports no worker's death: after
  FORK_SERVER_TIMEOUT_S the supervisor kills it and restarts its workers
  through a new one; SIGTERM, even while it is stopped, stops the server
  within its grace (before the fix: nothing restarted, SIGTERM hung)."""
  with LocalServer(one_dataset, workers=2) as server:
    old = _fork_server(server)
    victim, other = worker_pids(server)
    old.suspend()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: "is serving again" in server.stderr(), "a worker restarted")
    assert "fork server" in server.stderr() and "is stopped" in server.stderr()
    assert not psutil.pid_exists(old.pid) or old.status() == psutil.STATUS_ZOMBIE
    wait_for(lambda: len(worker_pids(server)) == 2, "both workers back")
    fresh = _fork_server(server)
    fresh.suspend()  # and SIGTERM while it is stopped
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # grace_s (5) + 5 s for the workers + FORK_SERVER_TIMEOUT_S, far below this bound;
    # measured ~1.5 s. Before the fix: no exit until the fork server resumed.
    assert server.proc.wait(60) == 0, server.stderr()
    assert time.monotonic() - started < 60


_OUT_OF_DESCRIPTORS = """
import logging, os, resource, signal, sys
from grain_elevator.server import Server, ServerOptions
if __name__ == "__main__":
  logging.basicConfig(level=logging.INFO)
  logging.getLogger("grain_elevator").setLevel(logging.INFO)
  server = Server(sys.argv[1], ServerOptions(port=0, workers=1)).start()
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  held = len(os.listdir("/proc/self/fd")) - 1  # not the listing's own
  resource.setrlimit(resource.RLIMIT_NOFILE, (held, hard))  # nothing more can open
  os.kill(server.worker_pids()[0], signal.SIGKILL)
  print("limited", flush=True)
  sys.stdin.readline()  # the test has seen the log
  resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
  sys.stdin.readline()
  server.stop()
"""


@pytest.mark.slow
def test_out_of_descriptors_at_a_restart_names_descriptors_and_clears(one_dataset, tmp_path):
  script = tmp_path / "nofile.py"
  script.write_text(_OUT_OF_DESCRIPTORS)
  log = tmp_path / "log.txt"
  with open(log, "w") as err:
    proc = subprocess.Popen([sys.executable, str(script), one_dataset], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True)
  try:
    assert proc.stdout.readline() == "limited\n"
    wait_for(lambda: "could not be restarted" in log.read_text(), "the failed restart")
    text = log.read_text()
    assert "out of file descriptors (Too many open files" in text, text
    assert "open-files limit" in text and "TMPDIR" not in text, text
    proc.stdin.write("\n")
    proc.stdin.flush()
    wait_for(lambda: "is serving again" in log.read_text(), "the restart once descriptors are back")
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(60) == 0, log.read_text()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
