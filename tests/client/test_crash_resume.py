"""A trainer killed with SIGKILL between checkpoints resumes with no gap and
no repeat: the ids it consumed up to its last checkpoint, plus those after the
restart, equal an uninterrupted run's."""

from __future__ import annotations

import pathlib
import queue
import signal
import subprocess
import sys
import threading
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


def _wait_for_line(proc: subprocess.Popen, line: str, timeout_s: float) -> str:
  """What `proc` printed up to `line` (it must print it within `timeout_s`);
  a thread reads its output, so a line waiting in a buffer is never missed."""
  lines: queue.SimpleQueue[str] = queue.SimpleQueue()
  threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout] + [lines.put("")],
                   daemon=True).start()
  out: list[str] = []
  deadline = time.monotonic() + timeout_s
  while not out or out[-1].strip() != line:
    try:
      got = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
      pytest.fail(f"no {line!r} in {timeout_s:g}s:\n{''.join(out)}")
    assert got, f"exited before {line!r}:\n{''.join(out)}"
    out.append(got)
  return "".join(out)


def test_sigkill_between_checkpoints_then_resume(server, oracle, tmp_path):
  ckpt, log1, log2 = tmp_path / "ckpt", tmp_path / "run1.log", tmp_path / "run2.log"
  cmd = [sys.executable, str(SCRIPT), "--target", server.target,
         "--global-batch-size", str(G), "--checkpoint-dir", str(ckpt),
         "--every", str(EVERY)]

  # It waits at step 23, past the checkpoint at 20 and before 25, for the
  # kill: between checkpoints however fast or slow it trains.
  run1 = subprocess.Popen(cmd + ["--log", str(log1), "--hold-at", "23"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  out = _wait_for_line(run1, "AT 23", 180)
  assert len(_log_steps(log1)) == 23, out
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
