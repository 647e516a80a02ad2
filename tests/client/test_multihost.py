"""Two JAX processes on one machine share each global batch; then the job
restarts as one process with 8 devices from the same checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import SCRIPTS

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "multihost.py"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def test_two_processes_then_one_from_the_same_checkpoint(server, config_path, tmp_path):
  ckpt = tmp_path / "ckpt"
  coordinator = f"127.0.0.1:{_free_port()}"
  common = ["--target", server.target, "--config", config_path,
            "--checkpoint-dir", str(ckpt)]
  procs = [subprocess.Popen(
      [sys.executable, str(SCRIPT), "--coordinator", coordinator,
       "--num-processes", "2", "--process-id", str(i), "--steps", "6", *common],
      env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = []
  for p in procs:
    out, _ = p.communicate(timeout=240)
    outs.append(out)
    assert p.returncode == 0, out
  for i, out in enumerate(outs):
    assert f"process {i}/2 devices 4: step 5 ok" in out, out
  files = sorted(f.name for f in (ckpt / "6" / "data").glob("process_*"))
  assert files == ["process_0-of-2.json", "process_1-of-2.json"]

  # Restart on one process with 8 devices: Grain's handler would look for
  # process_0-of-1.json; the global cursor resumes from either file.
  result = subprocess.run(
      [sys.executable, str(SCRIPT), "--steps", "4", "--resume", *common],
      env=_env(8), capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "process 0/1 devices 8: step 6 ok" in result.stdout
  assert "process 0/1 devices 8: step 9 ok" in result.stdout
