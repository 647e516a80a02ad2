"""The sharing benchmark measures 1, 2 and 4 readers with the cache and
without it, in one run, and checks the readers got the same bytes."""

from __future__ import annotations

import pytest

from helpers import run_bench

pytestmark = pytest.mark.slow


def test_server_cpu_is_measured_for_each_reader_count(tmp_path):
  out = run_bench("shared", "--data", str(tmp_path), "--rounds", "1", "--steps", "6",
                  "--records", "4096")
  rows = [l for l in out.splitlines() if l[:4] in ("| 1 ", "| 2 ", "| 4 ")]
  assert [r.split(" ")[1] for r in rows] == ["1", "2", "4"]
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c.split(" ")[0]) > 0 for c in cells[1:]), row
