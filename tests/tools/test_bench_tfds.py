"""`elevator bench-tfds` runs end to end and reports every system."""

from __future__ import annotations

import json
import subprocess

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR

pytest.importorskip("tensorflow_datasets")
pytestmark = pytest.mark.slow


def test_bench_tfds_reports_service_and_local_grain(tmp_path):
  out = tmp_path / "r.json"
  result = subprocess.run(
      [*ELEVATOR, "bench-tfds", "--records", "1500", "--seconds", "0.3", "--warmup", "0.1",
       "--repeats", "1", "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  for dataset in ("decoded", "augment"):
    systems = report["results"][dataset]
    assert len(systems) == 4
    service = systems["service, defaults (2 workers)"]
    assert service["records_per_s"] > 0 and service["server_cpu_s_per_1k"] > 0
  assert "| decoded | service, defaults (2 workers) |" in result.stdout
