"""`elevator demo`, `demo-lm` and `demo-torch` run end to end from nothing
and prove the resume exact."""

from __future__ import annotations

import subprocess

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR

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


def test_demo_lm_trains_on_packed_text_and_resumes_exactly(tmp_path):
  """A small transformer on a served stream dataset: loss falls, and the
  tokens it trained on across the stop are an uninterrupted run's."""
  result = subprocess.run([*ELEVATOR, "demo-lm", "--steps", "80", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "the new client resumes at step 40" in out
  assert "80 steps, 81,920 token slots: 0 lost, 0 repeated: identical to" in out
  loss = out.rsplit("; loss ", 1)[1].split()
  assert float(loss[2]) < float(loss[0]), out
  assert (tmp_path / "checkpoints" / "40" / "data" / "process_0-of-1.json").exists()


def test_demo_torch_trains_on_two_ranks_and_resumes_on_one(tmp_path):
  """torch.distributed (gloo) on 2 processes, DCP at the midpoint, 1 process
  to the end: every record once, the loss falling."""
  pytest.importorskip("torch", reason="the torch extra is not installed")
  result = subprocess.run([*ELEVATOR, "demo-torch", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "2 processes saved model, optimizer and data cursor at step 32" in out, out
  assert "[check]  4,096 records trained on: every record exactly once" in out, out
  loss = out.rsplit("; loss ", 1)[1].split()
  assert float(loss[2]) < float(loss[0]), out
  assert (tmp_path / "checkpoint" / ".metadata").exists()
