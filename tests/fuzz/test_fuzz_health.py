"""A bounded run of the health port's fuzzer (tests/fuzz/fuzz_health.py):
grpcio's recorded health calls and crafted floods (rapid reset, an HPACK
bomb, PING, SETTINGS and CONTINUATION floods, bad frames and settings),
mutated in frames and bytes, sent to a health port from addresses of their
own and ended every way a peer can end them. Every answer must be
well-formed HTTP/2, the real calls answered with their status, probes
answered between inputs, no traceback logged, no connection left open and
memory bounded. `make fuzz` runs the same for 30 minutes; here 3 seconds,
after the seeds, which go through first whatever the time. On HEAD before
issue #44's fix it found the reset connection left in the selector (finding
1: "accepting failed" tracebacks) within its first second."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # fuzzes for seconds, then waits out the port's timeouts

FUZZER = pathlib.Path(__file__).parent / "fuzz_health.py"


def test_the_health_port_survives_3_seconds_of_mutants(tmp_path):
  result = subprocess.run(
      [sys.executable, str(FUZZER), "--seconds", "3", "--seed", "17",
       "--out", str(tmp_path / "findings")],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert re.search(r"inputs in \d+ s, 0 findings$", result.stdout.rstrip()), \
      result.stdout[-3000:]
  seeds = re.search(r"seeds: (\d+) real .*, (\d+) crafted", result.stdout)
  inputs = re.search(r"(\d+) inputs in", result.stdout)
  assert seeds and inputs, result.stdout[-3000:]
  assert int(inputs[1]) > int(seeds[1]) + int(seeds[2])  # mutants too
  # Calls answered with a status, and the real Check's among them.
  assert re.search(r"answers: .*status 0 \d+", result.stdout), result.stdout[-3000:]
