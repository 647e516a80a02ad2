"""`elevator demo`, `demo-lm` and `demo-torch` run end to end from nothing
and prove the resume exact, with the fewest steps their flags allow that
still show it: `demo` 8, `demo-lm` 16 (its loss falls by then). `demo`
keeps its generated images: scikit-learn's digits, fewer, cost more to
import than 10,000 generated ones cost to write."""

from __future__ import annotations

import subprocess

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR

pytestmark = pytest.mark.slow


def test_demo_trains_stops_resumes_and_loses_nothing(tmp_path):
  result = subprocess.run(
      [*ELEVATOR, "demo", "--steps", "8", "--source", "generated", "--data-dir", str(tmp_path)],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "[mesh]   8 CPU devices" in out
  assert "restored params and cursor; new client resumes at step 4" in out
  assert "8 steps, 1,024 records: 0 lost, 0 repeated; identical to" in out
  assert "[server] stopped (exit 0)" in out
  assert (tmp_path / "checkpoints" / "4" / "data" / "process_0-of-1.json").exists()


def test_demo_lm_trains_on_packed_text_and_resumes_exactly(tmp_path):
  """A small transformer on a served stream dataset: loss falls, and the
  tokens it trained on across the stop are an uninterrupted run's."""
  result = subprocess.run([*ELEVATOR, "demo-lm", "--steps", "16", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "the new client resumes at step 8" in out
  assert "16 steps, 16,384 token slots: 0 lost, 0 repeated: identical to" in out
  loss = out.rsplit("; loss ", 1)[1].split()
  assert float(loss[2]) < float(loss[0]), out
  assert (tmp_path / "checkpoints" / "8" / "data" / "process_0-of-1.json").exists()


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
