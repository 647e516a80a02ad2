"""A bounded run of the positions fuzzer (tests/fuzz/fuzz_positions.py):
mutated stream positions of three stream shapes sent to a live server, each
answered with embedded mode's batches or a documented refusal, the server
healthy, exact, its workers alive and its sessions and memory bounded.
`make fuzz` runs the same for 30 minutes; here 4 seconds, in which
positions are both served (and compared) and refused."""

from __future__ import annotations

import pathlib
import re

import pytest

from helpers import run_fuzzer

pytestmark = pytest.mark.slow  # starts a server, then fuzzes for seconds

FUZZER = pathlib.Path(__file__).parent / "fuzz_positions.py"


def test_the_server_survives_4_seconds_of_made_up_positions(tmp_path):
  stdout = run_fuzzer(FUZZER, 4, tmp_path / "findings", "--check-every", "50")
  assert re.search(r"answers: .*INVALID_ARGUMENT \d+", stdout), stdout[-3000:]
  assert re.search(r"answers: .*\bok \d+", stdout), stdout[-3000:]
