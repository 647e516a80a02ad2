"""The text workload measures local Grain and the service side by side, in
one run, and states the goals of issue #28 from its own figures. Its steps
are G=4 rows (--global-batch-size), not 32: every system still packs,
resumes and reports, for an eighth of the tokens."""

from __future__ import annotations

import json
import subprocess

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR

pytestmark = pytest.mark.slow


G = 4  # rows a step


def test_every_system_is_measured_and_the_goals_are_stated(tmp_path):
  out = tmp_path / "r.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--workloads", "text", "--repeats", "1", "--seconds", "0.2",
       "--warmup", "0.1", "--text-records", "300", "--global-batch-size", str(G),
       "--data", str(tmp_path / "d"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  wl = json.loads(out.read_text())["workloads"]["text"]
  assert wl["global_batch_size"] == G and f"rows of 512 tokens, G={G}, 300 documents" in (
      result.stdout)
  rows = wl["systems"]
  assert list(rows) == ["grain_t0_mp0", "grain_t0_mp2", "grain_t16_mp0", "grain_t16_mp2",
                        "service_default", "service_w1"]
  for key, row in rows.items():
    (run,) = row["runs"]
    assert row["tokens_per_s"]["median"] == run["tokens_per_s"], key
    assert 0 <= run["padding_fraction"] < 1, key
    # Per core: tokens/s over the cores of whoever did the work.
    cores = run["server_cores"] if key.startswith("service") else run["client_cores"]
    assert run["tokens_per_core_s"] == pytest.approx(run["tokens_per_s"] / cores), key
  for key, row in rows.items():
    assert row["resume_first_batch_s"]["median"] > 0, key
  stdout = result.stdout
  assert "trainer CPU per token" in stdout and "tokens/s per server core" in stdout
  assert stdout.count("resume at step 10⁵") == 2
