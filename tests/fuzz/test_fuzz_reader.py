"""A bounded run of the shard-reader fuzzer (tests/fuzz/fuzz_reader.py):
server/data/shards/riegeli.c under ASan and UBSan, mutants of real shards (many with
re-signed headers) read by our reader and by ArrayRecord. Any crash,
sanitizer report, hang, differing bytes or unnamed refusal fails the test.
`make fuzz` runs the same for 30 minutes; here 4 seconds, after every seed
shard of the corpus, read first whatever the time."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # builds the sanitizer module, then fuzzes for seconds

FUZZER = pathlib.Path(__file__).parent / "fuzz_reader.py"
SKIP = 77  # the fuzzer's "cannot run here" (no gcc or libasan)


def test_the_reader_survives_4_seconds_of_mutants(tmp_path):
  result = subprocess.run(
      [sys.executable, str(FUZZER), "--seconds", "4", "--seed", "17",
       "--out", str(tmp_path / "findings")],
      capture_output=True, text=True, timeout=300)
  if result.returncode == SKIP:
    pytest.skip(f"no sanitizer build here: {result.stdout[-500:]}{result.stderr[-500:]}")
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert "0 findings" in result.stdout, result.stdout[-3000:]
  seeds = int(re.search(r"(\d+) seed shards", result.stdout).group(1))
  inputs = int(re.search(r"fuzz: (\d+) inputs in", result.stdout).group(1))
  assert inputs > seeds > 0, result.stdout[-3000:]  # every seed shard, and mutants
