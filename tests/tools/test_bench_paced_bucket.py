"""`python -m grain_elevator.tools.bench.paced_bucket`, small: it serves a
paced trainer from the stand-in store and from local files, and prints
both beside the pace and Little's law."""

from __future__ import annotations

import pytest

from helpers import run_bench

pytestmark = pytest.mark.slow  # two servers and a store


def test_it_prints_the_bucket_beside_local_files_and_the_limits(tmp_path):
  out = run_bench("paced_bucket", "--data", str(tmp_path), "--records", "512", "--seconds",
                  "2", "--pace", "400", "--ttfb-ms", "5,20", "--workers", "1")
  rows = [line for line in out.splitlines() if line.startswith("| ")]
  assert "× pace" in rows[0] and "Little's law" in rows[0], out
  bucket, local = rows[1], rows[2]
  assert bucket.startswith("| bucket | ") and local.startswith("| local files | "), out
  assert float(bucket.split("|")[2].replace(",", "")) > 0, out  # it took records
  assert local.split("|")[5].strip() == "0 (0)", out  # local files ask the store nothing
