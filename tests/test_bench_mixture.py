"""The mixing-cost benchmark measures the mixture and each component in one run."""

from __future__ import annotations

import pytest

from helpers import run_bench

pytestmark = pytest.mark.slow


def test_the_mixture_and_its_components_are_measured(tmp_path):
  out = run_bench("mixture", "--data", str(tmp_path), "--rounds", "1", "--seconds", "0.3",
                  "--records", "4096")
  rows = [l for l in out.splitlines() if l.startswith("| c") or l.startswith("| mix")]
  assert [r.split(" ")[1] for r in rows] == ["c1", "c2", "c3", "mix"]
  assert all(float(r.rsplit("|", 2)[1]) > 0 for r in rows)
