"""The client-settings A/B measures every setting against plain TCP in one
run, at each server size, with the real pipeline and the sleeping one."""

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
       "--warmup", "0.1", "--workers", "1", "--sleeping-workers", "3",
       "--sleep-us-per-record", "500", "--json", str(out),
       "--explore", '{"steps 2": {"transport": {"steps_per_request": 2}}}'],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())["large"]
  assert list(report) == ["W=1", "W=3 sleeping"]
  assert report["W=1"]["pipeline"] == "real"
  assert report["W=3 sleeping"]["pipeline"] == "sleeping 500 µs/record"
  for key, block in report.items():
    rows = block["rows"]
    assert list(rows) == ["default", "steps 2", "tuned (elevator bench's)", "plain TCP"], key
    for label, row in rows.items():
      assert row["median"] == row["runs"][0] > 0, (key, label)
      assert row["client_cpu_s_per_gb"] > 0, (key, label)
    assert rows["default"]["window"][0] > 0  # the client's stats: steps in flight
    assert rows["plain TCP"]["window"] == [None]
    ratio = rows["default"]["median"] / rows["tuned (elevator bench's)"]["median"]
    line = next(l for l in result.stdout.splitlines()
                if l.startswith(f"| large | {block['workers']}, ") and "**default**" in l)
    assert f"| {ratio:.2f} |" in line
  assert "large: default × best tuned W=1 " in result.stdout
