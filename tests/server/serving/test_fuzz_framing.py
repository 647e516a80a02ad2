"""Both transports' framing, fuzzed against a live server: random and
mutated bulk frames, and random bytes at the gRPC port (after and instead of
the HTTP/2 preface). No worker dies or logs a traceback, every bad
connection is closed or answered, and a client still reads the exact stream.
(Requests that parse but say odd things: tests/server/serving/test_fuzz_grpc.py.)"""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import framing
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import assert_streams_equal

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
VALID = framing.frame(framing.REQUEST, pb.BulkRequest(request=pb.BatchRequest(
    dataset="plain", global_batch_size=8, shard_count=1, num_steps=2)).SerializeToString())
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.fixture(scope="module")
def server(config_path):
  with LocalServer(config_path, workers=1, extra_args=("--idle-timeout-s", "5")) as s:
    yield s
    for kind in ("bulk", "grpc"):  # still exact after it all
      with RemoteDataset(s.target, "plain", 64, transport=TransportOptions(kind=kind)) as ds:
        with RemoteDataset.embedded(config_path, "plain", 64) as local:
          assert assert_streams_equal(ds, local) == 15
  assert s.proc.returncode == 0
  log = s.stderr()
  assert "restarting it" not in log, "a worker died"
  assert "Traceback" not in log, log[-3000:]


def _send(port: int, data: bytes, *, read: bool) -> bytes:
  """Sends `data`, half-closes, and (if `read`) returns what comes back
  before the server hangs up or goes quiet for a second."""
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    try:
      s.sendall(data)
      s.shutdown(socket.SHUT_WR)
    except OSError:
      return b""  # the server hung up already: as good
    if not read:
      return b""
    s.settimeout(1.0)
    got = bytearray()
    try:
      while chunk := s.recv(65536):
        got += chunk
    except (socket.timeout, ConnectionResetError):
      pass
    return bytes(got)


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
  out = bytearray(data)
  for at, value in flips:
    out[at % len(out)] = value
  return bytes(out[:cut % (len(out) + 1)]) if cut >= 0 else bytes(out)


kinds = st.sampled_from([0, framing.HELLO, framing.REQUEST, framing.BATCH, framing.STATUS, 255])
lengths = st.one_of(st.integers(0, 300), st.sampled_from([1 << 16, (1 << 16) + 1, 1 << 34,
                                                          2**64 - 1]))


@FUZZ
@given(kind=kinds, length=lengths, payload=st.binary(max_size=300), magic=st.booleans(),
       read=st.booleans())
def test_random_bulk_frames(server, kind, length, payload, magic, read):
  data = (framing.MAGIC if magic else b"") + framing.header(kind, length) + payload
  _send(server.bulk_port, data, read=read)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
       cut=st.integers(-1, 200), repeat=st.integers(1, 3), read=st.booleans())
def test_mutated_bulk_requests(server, flips, cut, repeat, read):
  got = _send(server.bulk_port, framing.MAGIC + _mutate(VALID * repeat, flips, cut),
              read=read)
  if read and got:
    assert got.startswith(framing.MAGIC)


@FUZZ
@given(preface=st.booleans(), data=st.binary(max_size=400))
def test_random_bytes_at_the_grpc_port(server, preface, data):
  _send(server.port, (H2_PREFACE if preface else b"") + data, read=False)
