"""`elevator demo` runs end to end from nothing and proves the resume exact."""

from __future__ import annotations

import subprocess

import pytest

from grain_elevator.tools.launcher import ELEVATOR

pytestmark = pytest.mark.slow


def test_demo_trains_stops_resumes_and_loses_nothing(tmp_path):
  result = subprocess.run(
      [*ELEVATOR, "demo", "--steps", "40", "--source", "generated",
       "--data-dir", str(tmp_path)],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "[mesh]   8 CPU devices" in out
  assert "restored params and cursor; new client resumes at step 20" in out
  assert "40 steps, 5,120 records: 0 lost, 0 repeated; identical to" in out
  assert "[server] stopped (exit 0)" in out
  assert (tmp_path / "checkpoints" / "20" / "data" / "process_0-of-1.json").exists()
