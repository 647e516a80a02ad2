"""The health port after connections end in every way a peer can end them
(server/serving/health_port.py): each probe after them is answered, and
what they cost is a throttled log line, never a traceback per connection.

Issue #44, finding 1: a connection reset before its greeting left its
closed socket registered in the loop's selector; the next connection given
that descriptor was never read (19 of 25 probes after one reset got only a
GOAWAY after 2 s), and each one logged a traceback (36,587 in 100 s). On
HEAD before the fix, each case here failed (checked with the old module
loaded in its place): probes unanswered within their 5 s deadline, or a
traceback in the log.

The health port runs in this process (HealthPort, the supervisor's thread):
the peers that end their connections here hold the GIL while the loop
waits for it, so many of them are reset in the listener's backlog, before
the loop has accepted them: the case that broke it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import h2.config
import h2.connection
import pytest
from grpc_health.v1 import health_pb2

from helpers import probe

SERVING = health_pb2.HealthCheckResponse.SERVING
PROBES = 25
ENDINGS = 60  # connections ended each way before the probes
_LINGER_0 = struct.pack("ii", 1, 0)  # close() sends RST


def _check_request() -> bytes:
  """A whole Check call's bytes, as a client sends them."""
  conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
  conn.initiate_connection()
  conn.send_headers(1, [(":method", "POST"), (":scheme", "http"),
                        (":path", "/grpc.health.v1.Health/Check"), (":authority", "x"),
                        ("content-type", "application/grpc"), ("te", "trailers")])
  conn.send_data(1, b"\0\0\0\0\0", end_stream=True)
  return conn.data_to_send()


_REQUEST = _check_request()
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
_HEADERS_ONLY = _REQUEST[:_REQUEST.rindex(b"\0\0\0\0\0") - 9]  # its DATA frame cut

# How a connection ends: what it sends first, and whether it resets (RST)
# rather than closes (FIN).
ENDS: dict[str, tuple[bytes, bool]] = {
    "reset at once": (b"", True),
    "closed at once": (b"", False),
    "reset after the preface": (_PREFACE, True),
    "reset mid-call": (_HEADERS_ONLY, True),
    "reset after its request, the answer unread": (_REQUEST, True),
    "closed after its request, the answer unread": (_REQUEST, False),
}


def _end(address: tuple[str, int], sent: bytes, reset: bool, source: str = "127.0.0.2"
         ) -> None:
  """One connection from `source` (not the probes' address, whose newest
  connections a flood of its own would take the place of), ended as said."""
  sock = socket.create_connection(address, timeout=5, source_address=(source, 0))
  if reset:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
  if sent:
    with contextlib.suppress(OSError):
      sock.sendall(sent)
  sock.close()


def _probe(address: tuple[str, int]) -> int | None:
  """A probe as the kubelet makes one (a fresh connection, one Check);
  None: no answer within its deadline."""
  return probe(f"{address[0]}:{address[1]}")


def _health_port_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
  return [r.getMessage() for r in caplog.records if "health port" in r.getMessage()]


@pytest.mark.parametrize("ending", list(ENDS))
def test_every_probe_is_answered_after_connections_end(lone_health_port, ending,
                                                      grain_elevator_logs):
  sent, reset = ENDS[ending]
  for _ in range(ENDINGS):
    _end(lone_health_port, sent, reset)
  answers = [_probe(lone_health_port) for _ in range(PROBES)]
  assert answers.count(SERVING) == PROBES, f"{ending}: {answers}"
  assert "Traceback" not in grain_elevator_logs.text
  # One line per period for each way a peer errs: a handful, not one each.
  lines = _health_port_lines(grain_elevator_logs)
  assert len(lines) <= 3, lines


def test_probes_are_answered_while_connections_are_reset(lone_health_port, grain_elevator_logs):
  # Resets from another thread while the probes run: a probe never gets a
  # descriptor that the loop has stopped reading.
  stop = threading.Event()

  def resets() -> None:
    while not stop.is_set():
      for sent, reset in ENDS.values():
        with contextlib.suppress(OSError):
          _end(lone_health_port, sent, reset)
  thread = threading.Thread(target=resets, daemon=True)
  thread.start()
  try:
    answers = [_probe(lone_health_port) for _ in range(PROBES)]
  finally:
    stop.set()
    thread.join()
  assert answers.count(SERVING) == PROBES, answers
  assert "Traceback" not in grain_elevator_logs.text
