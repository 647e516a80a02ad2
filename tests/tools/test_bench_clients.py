"""The client-settings A/B measures every setting against plain TCP in one run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_every_setting_and_the_wire_are_measured(tmp_path):
  out = tmp_path / "clients.json"
  result = subprocess.run(
      [sys.executable, "-m", "grain_elevator.tools.bench.clients", "--data", str(tmp_path),
       "--workloads", "large", "--records", "64", "--rounds", "1", "--seconds", "0.2",
       "--warmup", "0.1", "--json", str(out),
       "--explore", '{"steps 2": {"transport": {"steps_per_request": 2}}}'],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())["large"]
  assert list(rows) == ["default", "default + glibc tunables", "steps 2",
                        "tuned (elevator bench's)", "tuned + glibc tunables", "plain TCP"]
  for label, row in rows.items():
    assert row["median"] == row["runs"][0] > 0, label
    assert row["client_cpu_s_per_gb"] > 0, label
  best = max(rows["tuned (elevator bench's)"]["median"], rows["tuned + glibc tunables"]["median"])
  line = next(l for l in result.stdout.splitlines() if l.startswith("| large | default |"))
  assert f"| {rows['default']['median'] / best:.2f} |" in line
