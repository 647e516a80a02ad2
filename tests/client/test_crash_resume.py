"""A trainer killed with SIGKILL between checkpoints resumes with no gap and
no repeat: the ids it consumed up to its last checkpoint, plus those after the
restart, equal an uninterrupted run's."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import SCRIPTS, oracle_batch

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "train.py"
G, EVERY, TOTAL = 40, 5, 50  # aug2: 2 epochs of 1000 records


def _log_steps(log: pathlib.Path) -> list[tuple[int, list[int]]]:
  if not log.exists():
    return []
  rows = []
  for line in log.read_text().splitlines():
    step, *ids = map(int, line.split())
    rows.append((step, ids))
  return rows


def test_sigkill_between_checkpoints_then_resume(server, oracle, tmp_path):
  ckpt, log1, log2 = tmp_path / "ckpt", tmp_path / "run1.log", tmp_path / "run2.log"
  cmd = [sys.executable, str(SCRIPT), "--target", server.target,
         "--global-batch-size", str(G), "--checkpoint-dir", str(ckpt),
         "--every", str(EVERY)]

  run1 = subprocess.Popen(cmd + ["--log", str(log1), "--step-sleep", "0.2"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 180
  while len(_log_steps(log1)) < 23:  # past the checkpoint at 20, before 25
    assert run1.poll() is None, run1.stdout.read()
    assert time.monotonic() < deadline, "training made no progress"
    time.sleep(0.02)
  run1.send_signal(signal.SIGKILL)
  run1.wait()
  consumed1 = _log_steps(log1)
  saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  last_ckpt = saved[-1]
  assert last_ckpt < len(consumed1), "the kill must land between checkpoints"

  run2 = subprocess.run(cmd + ["--log", str(log2)], capture_output=True, text=True,
                        timeout=300)
  assert run2.returncode == 0, run2.stdout + run2.stderr
  assert f"resumed from checkpoint {last_ckpt}" in run2.stdout
  assert f"finished at step {TOTAL}" in run2.stdout

  stream = [row for row in consumed1 if row[0] < last_ckpt] + _log_steps(log2)
  assert [step for step, _ in stream] == list(range(TOTAL))  # no gap, no repeat
  for step, ids in stream:
    assert ids == oracle_batch(oracle, "aug2", step, G)["id"].tolist(), f"step {step}"
