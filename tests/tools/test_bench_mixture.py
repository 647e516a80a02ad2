"""The mixing-cost benchmark measures the mixture and each component in one
run (warmed up 0.1 s, not its default second, like the other benches' smoke
runs)."""

from __future__ import annotations

import pytest

from helpers import run_bench

pytestmark = pytest.mark.slow


def test_the_mixture_and_its_components_are_measured(tmp_path):
  out = run_bench("mixture", "--data", str(tmp_path), "--rounds", "1", "--seconds", "0.3",
                  "--warmup", "0.1", "--records", "4096")
  rows = [l for l in out.splitlines() if l.startswith("| c") or l.startswith("| mix")]
  assert [r.split(" ")[1] for r in rows] == ["c1", "c2", "c3", "mix"]
  rates = {}
  for row in rows:
    name, rate, ratio = (c.strip() for c in row.strip("|").split("|"))
    median, spread = rate.split(" ", 1)
    # One round: the median is the only run, so min and max are it too.
    assert spread == f"({median}–{median})", row
    rates[name.split(" ")[0]] = (float(median.replace(",", "")), float(ratio))
  mean = sum(r for n, (r, _) in rates.items() if n != "mix") / 3
  for name, (rate, ratio) in rates.items():
    assert ratio == pytest.approx(rate / mean, abs=0.01), name
