"""`elevator serve --idle-exit-s N`: a per-job data tier exits cleanly once its
job has stopped asking, and not while requests keep coming. Health checks do
not keep it alive (a kubelet probes forever)."""

from __future__ import annotations

import subprocess
import time

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.launcher import ELEVATOR, LocalServer


def _health(target: str) -> int:
  return subprocess.run([*ELEVATOR, "health", target], capture_output=True,
                        timeout=30).returncode


def test_exits_zero_after_the_last_request_despite_health_checks(config_path):
  with LocalServer(config_path, workers=2, extra_args=["--idle-exit-s", "3"]) as server:
    with RemoteDataset(server.target, "plain", 100, prefetch=0) as ds:
      it = iter(ds)
      for _ in range(6):  # requests every ~0.5 s: well inside the idle limit
        next(it)
        time.sleep(0.5)
        assert server.proc.poll() is None, "exited while requests were coming"
    # The job is gone; only probes remain.
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
      _health(server.target)
      time.sleep(0.3)
    assert server.proc.wait(5) == 0
    out = server.proc.stdout.read()
  assert "no request for 3s (--idle-exit-s): stopping" in out
  assert "elevator: stopped" in out


def test_a_bad_idle_exit_is_refused(config_path):
  result = subprocess.run([*ELEVATOR, "serve", "--config", config_path, "--idle-exit-s", "0"],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "idle_exit_s must be > 0" in result.stderr
