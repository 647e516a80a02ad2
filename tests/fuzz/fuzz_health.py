"""Fuzzes the health port's HTTP/2 (server/serving/health_port.py): what
any peer of the probe port may send.

    python tests/fuzz/fuzz_health.py --seconds 60 --seed 1 --out fuzz-findings
    python tests/fuzz/fuzz_health.py --replay fuzz-findings/health-0001.json

Why: the health port parses every byte a peer sends, from one thread that
every probe waits on; a bug there (an exception, a descriptor left in the
selector, an unbounded buffer) fails the kubelet's probes and restarts a
healthy pod. The seeds are
  * real: what grpcio sends for Check (known and unknown services), List
    and Watch, recorded at start through a proxy in front of the port;
  * crafted: rapid reset, an HPACK bomb, PING and SETTINGS floods, a
    CONTINUATION flood, frames of 2^24-1 bytes, padding past the frame,
    WINDOW_UPDATE overflow, DATA on stream 0, even and reused stream ids,
    settings out of range, PUSH_PROMISE from a client, unknown frame types,
    a request declaring HEALTH_MAX_REQUEST_BYTES + 1, compressed or
    undecodable requests, headers-only and half-sent calls, GET and unknown
    paths;
and each input is a seed mutated in its frames (a header field set to an
edge, frames duplicated by the hundred, dropped, swapped, spliced from
another seed, payloads cut) and in its bytes, sent in random pieces from an
address of its own (127.1.x.y: each peer's budget is its own), then closed
(FIN), reset (RST) after its answer or at once, or left until the server
closes it.

What the server sends back must be well-formed HTTP/2 whose headers decode
(HPACK); an unmutated real seed must get its gRPC status (0, or 5 for the
unknown service). Every --check-every inputs a probe from 127.0.0.1 must be
answered SERVING within --probe-timeout; no log line may carry a traceback
or be an ERROR; at the end the port must hold no connection once its
timeouts have passed, and this process's RSS must have grown less than
--rss-mb. The first --keep findings are printed and saved under --out
(health-*.json, which --replay sends again); the run exits 1 if there were
any.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import pathlib
import random
import socket
import struct
import sys
import threading
import time
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import hpack
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.server.serving import health_port as hp
from grain_elevator.tools.testing import h2peer
from grain_elevator.tools.testing.h2peer import H2Peer

PREFIX = "fuzz-health:"
SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICES = ("", "grain_elevator.v1.Elevator")
CHECK, LIST, WATCH = (f"/grpc.health.v1.Health/{m}" for m in ("Check", "List", "Watch"))
PREFACE = h2peer.PREFACE
QUIET_S = 0.02  # an input's answer is over once the server is this quiet
READ_S = 0.3  # and read for this long at most
# "wait": read until the server closes, READ_S at most; "abort": reset at
# once, unread (often before the server has accepted it: a load balancer's
# TCP check, a port scan).
ENDS = ("fin", "rst", "wait", "abort")
END_WEIGHTS = (0.4, 0.35, 0.1, 0.15)
EDGES = (0, 1, 4, 5, 8, 9, 255, 256, 1 << 14, (1 << 14) + 1, (1 << 24) - 1)
STREAM_EDGES = (0, 1, 2, 3, 5, 7, 9, 1001, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)


# Seeds -----------------------------------------------------------------------

def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
  return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
      ">I", stream_id) + payload


def _headers(path: str, method: str = "POST") -> list[tuple[str, str]]:
  return [(":method", method), (":scheme", "http"), (":path", path), (":authority", "x"),
          ("content-type", "application/grpc"), ("te", "trailers")]


def _call(path: str, message: bytes | None, *, method: str = "POST", end: bool = True,
          calls: int = 1) -> bytes:
  """A client's flight: the preface, then `calls` calls to `path`, each with
  `message` (None: headers only)."""
  conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
  conn.initiate_connection()
  for i in range(calls):
    stream = 2 * i + 1
    conn.send_headers(stream, _headers(path, method), end_stream=message is None and end)
    if message is not None:
      conn.send_data(stream, message, end_stream=end)
  return conn.data_to_send()


def _grpc(message: bytes, compressed: int = 0, declared: int | None = None) -> bytes:
  return bytes([compressed]) + struct.pack(">I", len(message) if declared is None
                                           else declared) + message


def crafted() -> dict[str, bytes]:
  """The hand-made seeds (module docstring)."""
  check = _grpc(health_pb2.HealthCheckRequest().SerializeToString())
  settings = PREFACE + _frame(0x4, 0, 0, b"")
  out = {
      "rapid reset": h2peer.rapid_reset_bytes(40),
      "hpack bomb": h2peer.hpack_bomb_bytes(2000),
      "ping flood": settings + _frame(0x6, 0, 0, bytes(8)) * 200,
      "settings flood": settings + _frame(0x4, 0, 0, b"") * 200,
      "continuation flood": (settings + _frame(0x1, 0, 1, b"\x82")
                             + _frame(0x9, 0, 1, b"\x86") * 300),
      "huge frame": settings + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + bytes(100),
      "pad past the frame": settings + _frame(0x0, 0x8, 1, b"\xff" + bytes(4)),
      "window overflow": settings + _frame(0x8, 0, 0, struct.pack(">I", (1 << 31) - 1)) * 2,
      "data on stream 0": settings + _frame(0x0, 0x1, 0, check),
      "even stream": settings + _frame(0x1, 0x5, 2, b"\x83\x86\x84"),
      "settings out of range": settings + _frame(0x4, 0, 0, struct.pack(">HI", 4, 1 << 31)
                                                 + struct.pack(">HI", 5, 1)),
      "push promise": settings + _frame(0x5, 0x4, 1, struct.pack(">I", 2) + b"\x82"),
      "unknown frame": settings + _frame(0xEE, 0xFF, 1, b"junk"),
      "self dependency": settings + _frame(0x2, 0, 1, struct.pack(">IB", 1, 16)),
      "oversized request": _call(CHECK, _grpc(b"", declared=hp.HEALTH_MAX_REQUEST_BYTES + 1)),
      "compressed request": _call(CHECK, _grpc(b"", compressed=1)),
      "undecodable request": _call(CHECK, _grpc(b"\xff\xff\xff")),
      "headers only": _call(CHECK, None, end=False),
      "half a message": _call(CHECK, check[:3], end=False),
      "get": _call(CHECK, check, method="GET"),
      "unknown path": _call("/grain_elevator.v1.Elevator/Describe", check),
      "too many streams": _call(CHECK, None, end=False,
                                calls=hp.HEALTH_MAX_STREAMS_PER_CONNECTION + 4),
      "many checks": _call(CHECK, check, calls=3),
      "watch": _call(WATCH, check, end=False),
      "goaway": settings + _frame(0x7, 0, 0, struct.pack(">II", 0, 0)),
  }
  return out


def real(port: int) -> dict[str, tuple[bytes, set[str]]]:
  """What grpcio sends for each health call (recorded through a proxy in
  front of the port), and the gRPC statuses it must be answered with."""
  listener = socket.create_server(("127.0.0.1", 0))
  proxy = listener.getsockname()[1]
  recorded: list[bytearray] = []

  def pump(src: socket.socket, dst: socket.socket, into: bytearray | None) -> None:
    try:
      while data := src.recv(1 << 16):
        if into is not None:
          into += data
        dst.sendall(data)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass

  def serve() -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return
      upstream = socket.create_connection(("127.0.0.1", port))
      recorded.append(bytearray())
      for a, b, into in ((client, upstream, recorded[-1]), (upstream, client, None)):
        threading.Thread(target=pump, args=(a, b, into), daemon=True).start()

  threading.Thread(target=serve, daemon=True).start()
  calls = {
      "grpcio Check": (lambda s: s.Check(health_pb2.HealthCheckRequest(), timeout=5), {"0"}),
      "grpcio Check of a service": (lambda s: s.Check(health_pb2.HealthCheckRequest(
          service=SERVICES[1]), timeout=5), {"0"}),
      "grpcio Check of an unknown service": (lambda s: s.Check(
          health_pb2.HealthCheckRequest(service="nope"), timeout=5), {"5"}),
      "grpcio List": (lambda s: s.List(health_pb2.HealthListRequest(), timeout=5), {"0"}),
      "grpcio Watch": (lambda s: next(s.Watch(health_pb2.HealthCheckRequest(), timeout=5)),
                       set()),
  }
  out = {}
  for name, (call, statuses) in calls.items():
    with grpc.insecure_channel(f"127.0.0.1:{proxy}",
                               options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
      try:
        call(health_pb2_grpc.HealthStub(channel))
      except grpc.RpcError:
        pass  # NOT_FOUND: the unknown service
    time.sleep(0.05)  # the proxy has passed on what the client sent last
    out[name] = (bytes(recorded[-1]), statuses)
  listener.close()
  return out


# Mutation --------------------------------------------------------------------

def split(data: bytes) -> tuple[bytes, list[bytes], bytes]:
  """(preface, whole frames, what is left after them)."""
  head = PREFACE if data.startswith(PREFACE) else b""
  frames, i = [], len(head)
  while i + 9 <= len(data):
    end = i + 9 + int.from_bytes(data[i:i + 3], "big")
    if end > len(data):
      break
    frames.append(data[i:end])
    i = end
  return head, frames, data[i:]


def mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
  """1-4 mutations of `data` (module docstring)."""
  for _ in range(rng.randint(1, 4)):
    head, frames, tail = split(data)
    how = rng.choice(("field", "field", "dup", "drop", "swap", "splice", "cut payload",
                      "bytes", "truncate", "insert"))
    if frames and how == "field":
      i = rng.randrange(len(frames))
      f = bytearray(frames[i])
      field = rng.choice(("length", "type", "flags", "stream"))
      if field == "length":
        near = max(0, len(f) - 9 + rng.randint(-3, 3))
        f[0:3] = (rng.choice(EDGES + (near,)).to_bytes(3, "big") if rng.random() < 0.9
                  else rng.randbytes(3))
      elif field == "type":
        f[3] = rng.randrange(0, 12) if rng.random() < 0.8 else rng.randrange(256)
      elif field == "flags":
        f[4] = rng.choice((0, 1, 4, 5, 8, 0x20, 0x25, 0x2D, 0xFF))
      else:
        f[5:9] = struct.pack(">I", rng.choice(STREAM_EDGES))
      frames[i] = bytes(f)
    elif frames and how == "dup":
      i = rng.randrange(len(frames))
      frames[i:i + 1] = [frames[i]] * rng.choice((2, 3, 10, 100, 300))
    elif frames and how == "drop":
      del frames[rng.randrange(len(frames))]
    elif len(frames) > 1 and how == "swap":
      i, j = rng.sample(range(len(frames)), 2)
      frames[i], frames[j] = frames[j], frames[i]
    elif how == "splice":
      _, others, _ = split(rng.choice(seeds))
      if others:
        frames.insert(rng.randint(0, len(frames)), rng.choice(others))
    elif frames and how == "cut payload":
      i = rng.randrange(len(frames))
      frames[i] = frames[i][:rng.randint(0, len(frames[i]))]
    data = head + b"".join(frames) + tail
    if how == "bytes" and data:
      b = bytearray(data)
      for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
      data = bytes(b)
    elif how == "truncate" and data:
      data = data[:rng.randrange(len(data))]
    elif how == "insert":
      at = rng.randint(0, len(data))
      data = data[:at] + rng.randbytes(rng.randint(1, 40)) + data[at:]
  return data[:1 << 20]


# Sending ---------------------------------------------------------------------

def source_of(i: int) -> str:
  """An address of its own for input `i`: 127.1.0.1 and on (never 127.0.0.1,
  the probes')."""
  i %= 250 * 250
  return f"127.1.{i // 250}.{i % 250 + 1}"


def send(port: int, pieces: list[bytes], end: str, source: str) -> bytes:
  """Sends `pieces`, reads what comes back until the server is quiet (or
  closes), then ends the connection as `end` says; returns what came."""
  got = bytearray()
  with socket.create_connection(("127.0.0.1", port), timeout=2,
                                source_address=(source, 0)) as sock:
    if end in ("rst", "abort"):
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
      for piece in pieces:
        sock.sendall(piece)
      if end == "abort":
        return b""
      deadline = time.monotonic() + READ_S
      sock.settimeout(QUIET_S)
      while time.monotonic() < deadline:
        try:
          data = sock.recv(1 << 16)
        except socket.timeout:
          if end != "wait":
            break
          continue
        if not data:
          break
        got += data
    except OSError:
      pass
  return bytes(got)


def _end(rng: random.Random) -> str:
  return rng.choices(ENDS, END_WEIGHTS)[0]


def table_size(sent: bytes) -> int:
  """The HPACK table the server may use toward us: the last
  SETTINGS_HEADER_TABLE_SIZE that `sent` (mutated, it may be any) gives,
  else HTTP/2's 4,096. A larger one than the decoder's default is the
  server's right (RFC 7541 4.2), not a finding."""
  size = 4096
  for f in split(sent)[1]:
    if f[3] == 0x4 and not f[4] & 0x1:  # SETTINGS, not an ACK
      payload = f[9:]
      for i in range(0, len(payload) - len(payload) % 6, 6):
        if int.from_bytes(payload[i:i + 2], "big") == 0x1:
          size = int.from_bytes(payload[i + 2:i + 6], "big")
  return size


def answered(data: bytes, sent: bytes = b"") -> tuple[set[str], str | None]:
  """The gRPC statuses in the server's frames, and what is wrong with them
  (None: well-formed HTTP/2 whose header blocks decode); `sent`: what we
  sent, whose settings bound the server's header table."""
  if not data:
    return set(), None
  _, frames, _ = split(PREFACE + data)  # the server sends no preface
  decoder = hpack.Decoder()
  decoder.max_allowed_table_size = table_size(sent)
  decoder.max_header_list_size = 1 << 20
  statuses, block = set(), b""
  for f in frames:
    kind, flags, payload = f[3], f[4], f[9:]
    if kind == 0x1:  # HEADERS: the server sends no padding or priority
      block = payload
    elif kind == 0x9:
      block += payload
    else:
      continue
    if flags & 0x4:  # END_HEADERS
      try:
        headers = decoder.decode(block, raw=True)
      except hpack.HPACKError as e:
        return statuses, f"the server's headers do not decode: {e}"
      statuses.update(v.decode() for k, v in headers if k == b"grpc-status")
  return statuses, None


# The run ---------------------------------------------------------------------

class _Records(logging.Handler):
  def __init__(self) -> None:
    super().__init__(logging.WARNING)
    self.bad: list[str] = []
    self.lines = 0

  def emit(self, record: logging.LogRecord) -> None:
    self.lines += 1
    if record.exc_info or record.levelno >= logging.ERROR:
      self.bad.append(self.format(record)[-2000:])


def probe(port: int, timeout_s: float) -> str | None:
  """A Check from 127.0.0.1 over raw HTTP/2; what is wrong (None: SERVING)."""
  try:
    peer = H2Peer("127.0.0.1", port, timeout_s=timeout_s, source="127.0.0.1")
  except OSError as e:
    return f"a probe could not connect: {e}"
  try:
    call = peer.open_call(CHECK, declared_bytes=0)
    deadline = time.monotonic() + timeout_s
    while call not in peer.statuses():
      if time.monotonic() > deadline:
        return f"a probe was not answered within {timeout_s:g}s"
      peer.read(0.05)
    status = peer.statuses()[call]
    return None if status == "0" else f"a probe was answered {status}"
  except ConnectionResetError:
    return "a probe's connection was closed unanswered"
  finally:
    peer.close()


def held(port: int) -> int:
  """The port's connections this process still holds (server side)."""
  return sum(1 for c in psutil.Process().net_connections("tcp")
             if c.laddr.port == port and c.raddr
             and c.status in (psutil.CONN_ESTABLISHED, psutil.CONN_CLOSE_WAIT))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seconds", type=float, default=60)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="fuzz-findings")
  parser.add_argument("--keep", type=int, default=5)
  parser.add_argument("--check-every", type=int, default=25)
  parser.add_argument("--probe-timeout", type=float, default=2.0)
  parser.add_argument("--rss-mb", type=float, default=200)
  parser.add_argument("--replay")
  args = parser.parse_args(argv)
  records = _Records()
  logging.getLogger("grain_elevator").addHandler(records)
  port = hp.HealthPort(lambda: SERVING, SERVICES, watch_s=1.0)
  number = port.start("127.0.0.1", 0)
  findings: list[dict[str, Any]] = []
  counts: collections.Counter[str] = collections.Counter()
  started = time.monotonic()
  inputs = 0

  def finding(why: str, case: dict[str, Any] | None) -> None:
    findings.append({"why": why, **(case or {})})
    if len(findings) <= args.keep:
      print(f"{PREFIX} finding {len(findings)}: {why}", flush=True)
      if case is not None:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"health-{len(findings):04d}.json").write_text(json.dumps(
            {"why": why, **case}, indent=1))

  def run(case: dict[str, Any], expect: set[str] | None = None) -> None:
    nonlocal inputs
    inputs += 1
    pieces = [bytes.fromhex(p) for p in case["pieces"]]
    got = send(number, pieces, case["end"], case["source"])
    statuses, wrong = answered(got, b"".join(pieces))
    counts.update(f"status {s}" for s in statuses)
    counts["silent" if not got else "answered"] += 1
    if wrong is not None:
      finding(wrong, case)
    if expect and not expect <= statuses:
      finding(f"{case['seed']}: answered {sorted(statuses)}, not {sorted(expect)}", case)
    if records.bad:
      finding(f"logged: {records.bad[0]}", case)
      records.bad.clear()
    if inputs % args.check_every == 0 or case.get("replayed"):
      if not port._thread.is_alive():  # pylint: disable=protected-access
        finding("the health port's thread died", case)
        return
      if (why := probe(number, args.probe_timeout)) is not None:
        finding(f"after input {inputs}: {why}", case)

  try:
    if args.replay:
      case = json.loads(pathlib.Path(args.replay).read_text())
      case["replayed"] = True
      run(case)
    else:
      rss_before = psutil.Process().memory_info().rss
      rng = random.Random(args.seed)
      reals = real(number)
      made = crafted()
      print(f"{PREFIX} seeds: {len(reals)} real (grpcio, recorded), {len(made)} crafted",
            flush=True)
      seeds = [d for d, _ in reals.values()] + list(made.values())
      names = list(reals) + list(made)
      for name, (data, expect) in reals.items():  # first, whatever the time
        run({"seed": name, "pieces": [data.hex()], "end": "fin", "source": source_of(inputs)},
            expect)
      for name, data in made.items():
        run({"seed": name, "pieces": [data.hex()], "end": _end(rng),
             "source": source_of(inputs)})
      while time.monotonic() - started < args.seconds:
        i = rng.randrange(len(seeds))
        data = mutate(rng, seeds[i], seeds)
        count = max(0, min(len(data) - 1, rng.randint(0, 4)))
        cuts = sorted(rng.sample(range(1, len(data)), count))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        run({"seed": names[i], "pieces": [p.hex() for p in pieces if p],
             "end": _end(rng), "source": source_of(inputs)})
      if (why := probe(number, args.probe_timeout)) is not None:
        finding(f"at the end: {why}", None)
      # Every connection ends within the port's timeouts once its peer is gone.
      deadline = time.monotonic() + hp.HEALTH_IDLE_TIMEOUT_S + 5
      while held(number) and time.monotonic() < deadline:
        time.sleep(0.1)
      if left := held(number):
        finding(f"{left} connections still open after the port's timeouts", None)
      grown = (psutil.Process().memory_info().rss - rss_before) / 2**20
      if grown > args.rss_mb:
        finding(f"RSS grew {grown:.0f} MB (more than --rss-mb {args.rss_mb:g})", None)
  finally:
    port.stop()
  print(f"{PREFIX} answers: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        flush=True)
  print(f"{PREFIX} {records.lines} log lines (throttled)", flush=True)
  print(f"{PREFIX} {inputs} inputs in {time.monotonic() - started:.0f} s, "
        f"{len(findings)} findings", flush=True)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())
