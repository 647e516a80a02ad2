"""The sharing benchmark measures 1, 2 and 4 readers with the cache and
without it, in one run, and checks the readers got the same bytes."""

from __future__ import annotations

import pytest

from helpers import run_bench

pytestmark = pytest.mark.slow


def test_server_cpu_is_measured_for_each_reader_count(tmp_path):
  out = run_bench("shared", "--data", str(tmp_path), "--rounds", "1", "--steps", "6",
                  "--records", "4096")
  assert "6 steps of the same stream per reader" in out
  rows = [l for l in out.splitlines() if l[:4] in ("| 1 ", "| 2 ", "| 4 ")]
  assert [r.split(" ")[1] for r in rows] == ["1", "2", "4"]
  one = [c.strip() for c in rows[0].strip("|").split("|")][1:]
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert len(cells) == 4, row  # cache on and off: CPU-s (× 1 reader), steps/s
    for cpu, cpu_one in ((cells[0], one[0]), (cells[2], one[2])):
      seconds, times = cpu.split(" ")
      # The ratio is this row's CPU over one reader's, as printed.
      assert float(times.strip("(×)")) == pytest.approx(
          float(seconds) / float(cpu_one.split(" ")[0]), abs=0.02), row
