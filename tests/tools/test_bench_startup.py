"""`python -m grain_elevator.tools.bench.startup`: a build's start-up and a
worker's restart, measured end to end (no time is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_start_and_a_restart_are_measured(config_path):
  done = subprocess.run([sys.executable, "-m", "grain_elevator.tools.bench.startup",
                         config_path, sys.executable, "--rounds", "1"],
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  (row,) = [l for l in done.stdout.splitlines() if l.startswith(f"| {sys.executable} |")]
  start, restart = [float(m) for m in re.findall(r"\| ([\d.]+) \(", row)]
  assert start > 0 and restart > 0
