"""Two JAX processes on one machine share each global batch; then the job
restarts as one process with 8 devices from the same checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import SCRIPTS

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "multihost.py"


def _stages(out, stages: list[dict]) -> list[list[str]]:
  """Runs each stage's JAX processes (tests/scripts/multihost.py: one
  launcher, its processes forked after its imports), one job after another;
  each process's output, by stage."""
  run = subprocess.run(
      [sys.executable, str(SCRIPT), "--out", str(out),
       *[arg for stage in stages for arg in ("--stage", json.dumps(stage))]],
      capture_output=True, text=True, timeout=480)
  logs = {p.name: p.read_text() for p in sorted(out.glob("stage*-process*.log"))}
  assert run.returncode == 0, f"{run.stdout}{run.stderr}\n{logs}"
  return [[logs[f"stage{s}-process{i}.log"] for i in range(stage["processes"])]
          for s, stage in enumerate(stages)]


def test_two_processes_then_one_from_the_same_checkpoint(server, config_path, tmp_path):
  ckpt = tmp_path / "ckpt"
  common = ["--target", server.target, "--config", config_path,
            "--checkpoint-dir", str(ckpt)]
  # Restarted on one process with 8 devices: Grain's handler would look for
  # process_0-of-1.json; the global cursor resumes from either file.
  outs, (resumed,) = _stages(tmp_path, [
      {"processes": 2, "devices": 4, "args": ["--steps", "6", *common]},
      {"processes": 1, "devices": 8, "args": ["--steps", "4", "--resume", *common]}])
  for i, out in enumerate(outs):
    assert f"process {i}/2 devices 4: step 5 ok" in out, out
  files = sorted(f.name for f in (ckpt / "6" / "data").glob("process_*"))
  assert files == ["process_0-of-2.json", "process_1-of-2.json"]
  assert "process 0/1 devices 8: step 6 ok" in resumed, resumed
  assert "process 0/1 devices 8: step 9 ok" in resumed, resumed
