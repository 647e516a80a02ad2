"""The mixing-cost benchmark measures the mixture and each component in one run."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_mixture_and_its_components_are_measured(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "grain_elevator.tools.bench.mixture", "--data", str(tmp_path),
       "--rounds", "1", "--seconds", "0.3", "--records", "4096"],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [l for l in result.stdout.splitlines() if l.startswith("| c") or l.startswith("| mix")]
  assert [r.split(" ")[1] for r in rows] == ["c1", "c2", "c3", "mix"]
  assert all(float(r.rsplit("|", 2)[1]) > 0 for r in rows)
