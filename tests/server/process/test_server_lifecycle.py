"""`elevator serve` as a process: workers, restarts, clean shutdown. (A
worker's restart is the supervisor's alone: an in-process Server shows it,
and its log, in this process.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR, LocalServer
from grain_elevator.client import RemoteDataset
from grain_elevator.server import Server, ServerOptions
from helpers import assert_trees_equal, oracle_batch, worker_pids

pytestmark = pytest.mark.slow  # servers signalled, killed, restarted


def _wait_for(predicate, timeout: float = 60.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.1)
  return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_worker_and_exits_zero(config_path, sig):
  server = LocalServer(config_path, workers=2)
  workers = worker_pids(server)
  assert len(workers) == 2
  server.proc.send_signal(sig)
  assert server.proc.wait(60) == 0, server.stderr()
  assert _wait_for(lambda: not any(os.path.exists(f"/proc/{w}") for w in workers), 10)


def test_a_killed_worker_is_restarted_and_logged(config_path, oracle, grain_elevator_logs):
  with Server(config_path, ServerOptions(port=0, workers=2)) as server:
    victim = server.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    assert _wait_for(lambda: "restarting it" in grain_elevator_logs.text)
    assert "killed by signal SIGKILL" in grain_elevator_logs.text
    assert _wait_for(lambda: len(server.worker_pids()) == 2 and victim not in server.worker_pids())
    with RemoteDataset(server.target, "seed3", 64) as ds:
      assert_trees_equal(next(iter(ds)), oracle_batch(oracle, "seed3", 0, 64))


def test_a_server_that_never_says_ready_is_killed_and_reported(config_path):
  """The launcher bounds the wait for the ready line (a stuck start fails the
  test that started it, not every test after)."""
  stuck = (sys.executable, "-c", "import time; time.sleep(120)")  # takes serve's argv
  with pytest.raises(RuntimeError, match=r"did not start \(not ready after 1 s, killed\)"):
    LocalServer(config_path, prefix=stuck, start_timeout_s=1)


def test_port_in_use_is_a_clear_error(config_path):
  with socket.socket() as holder:  # no SO_REUSEPORT: nobody may share it
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    result = subprocess.run(
        [*ELEVATOR, "serve", "--config", config_path, "--port", str(port),
                    "--workers", "1"],
        capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert f"elevator: error: cannot bind 127.0.0.1:{port}" in result.stderr


def test_workers_get_the_allocator_settings_unless_the_operator_set_them(config_path):
  operator = ("env", "-u", "MALLOC_MMAP_THRESHOLD_", "-u", "MALLOC_TRIM_THRESHOLD_",
              "NUMPY_MADVISE_HUGEPAGE=1")
  with LocalServer(config_path, workers=1, prefix=operator) as server:
    (pid,) = worker_pids(server)
    with open(f"/proc/{pid}/environ", "rb") as f:
      env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
  assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
  assert env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
  assert env["NUMPY_MADVISE_HUGEPAGE"] == "1"  # the operator's choice stands
