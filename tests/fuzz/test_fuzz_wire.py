"""A bounded run of the wire fuzzer (tests/fuzz/fuzz_wire.py): mutated
batches through the client's decoding, mutated bulk sessions against a live
server (checked against a model of the protocol), mutated answers of a fake
bulk server to the bulk client, under a memory bound. Any exception other
than the documented refusals, a batch accepted against its element spec, an
answer the model does not predict, a connection left open, a traceback in
the server's log or a stream that differs afterwards fails the test.
`make fuzz` runs the same for 30 minutes; here 3 seconds, after the seed
batches and streams, which the decode and client targets go through first
whatever the time; each of the three targets must have had inputs."""

from __future__ import annotations

import pathlib
import re

import pytest

from helpers import run_fuzzer

pytestmark = pytest.mark.slow  # starts a server, then fuzzes for seconds

FUZZER = pathlib.Path(__file__).parent / "fuzz_wire.py"


def test_the_wire_survives_3_seconds_of_mutants(tmp_path):
  stdout = run_fuzzer(FUZZER, 3, tmp_path / "findings")
  for target in ("decode", "server", "client"):
    assert re.search(rf"^fuzz-wire: {target}: [1-9]\d* inputs, 0 findings", stdout,
                     re.M), (target, stdout[-3000:])
