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

import pytest

from helpers import run_fuzzer

pytestmark = pytest.mark.slow  # fuzzes for seconds, then waits out the port's timeouts

FUZZER = pathlib.Path(__file__).parent / "fuzz_health.py"


def test_the_health_port_survives_3_seconds_of_mutants(tmp_path):
  stdout = run_fuzzer(FUZZER, 3, tmp_path / "findings")
  seeds = re.search(r"seeds: (\d+) real .*, (\d+) crafted", stdout)
  inputs = re.search(r"(\d+) inputs in", stdout)
  assert seeds and inputs, stdout[-3000:]
  assert int(inputs[1]) > int(seeds[1]) + int(seeds[2])  # mutants too
  # Calls answered with a status, and the real Check's among them.
  assert re.search(r"answers: .*status 0 \d+", stdout), stdout[-3000:]
