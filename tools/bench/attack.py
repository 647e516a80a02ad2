"""The service under attack: what a well-behaved trainer sees, side by side.

    python -m grain_elevator.tools.bench.attack [--steps 3000] [--workers 2]

Serves a small image dataset with DEFAULT options and reads it with a
DEFAULT client: alone, while each kind of hostile client runs (a process of
its own, so it shares no GIL with the trainer), then while all of them run.
They do what server/serving/admission.py, server/serving/bulk.py and server/serving/grpc_service.py
defend against:

  grpc-unread   64 GetBatches streams of an endless stream, never read;
                each one cut is opened again at once
  bulk-unread   64 bulk connections asking for an endless stream, with a
                4 KiB receive buffer, never read; reopened when cut
  bulk-idle     2,000 greeted bulk connections that send nothing (past the
                1,024 cap per worker); reopened when closed
  oversize      connections promising a 2**34-byte request, then junk
  slowloris     200 connections sending a request header a byte every 2 s,
                then holding them
  headers       header-only gRPC calls (headers, never a message) to Describe,
                GetBatches and health Check, as many as each of 8 connections
                may carry (the server's stream limit); each one cut is opened
                again at once
  halfsent      400 gRPC calls (20 connections x 20) declaring a request of
                MAX_REQUEST_BYTES - 1024 bytes and sending all of it but the
                last byte; reopened when cut
  idlegrpc      900 idle HTTP/2 connections to the gRPC port (preface and
                settings, then nothing but acknowledgements), spread over
                the workers; reopened when closed (past the cap, the trainer
                could not connect: tests/server/serving/test_health_port.py
                shows probes on the health port then)
  watch         130 connections to the gRPC port, each holding one health
                Watch sent without a token; reopened when ended or closed

With --health, the health port's own floods instead (tools/testing/h2peer.py
`flood`), each from a process of its own for --seconds while probes come
every 0.1 s from 127.0.0.1, as a kubelet's do:

  rapid-reset   125 connections/s from 127.0.0.2, each 100 HEADERS + RST_STREAM
  ping          PING frames nonstop from 127.0.0.2
  settings      empty SETTINGS frames nonstop from 127.0.0.2
  hpack         125 connections/s from 127.0.0.2, each one HPACK bomb
  reset         250 connections/s from 127.0.0.2, each reset as it connects
  connect-many  500 connections/s from 200 addresses (127.0.1.x), 256 held
  connect-same  500 connections/s from the prober's own address, 16 held

and reports the probes' p50, p99, max and failures, and the supervisor's
CPU (the health port is one of its threads) over the flood.

The last four are raw HTTP/2 peers (the `h2` library, tools/testing/h2peer.py),
what no gRPC client library sends on purpose; each says on stderr, when it
ends, how many calls the server cut, refused (REFUSED_STREAM) and let it hold.

Every run checks each batch against embedded mode (bit for bit) and reports
steps/s, the workers' peak RSS and the latency of health checks, each on a
fresh connection every 0.25 s as a kubelet probe makes (an error or an
answer other than SERVING counts as a failed probe), side by side: on the
health port (--health-port, server/serving/health_port.py), where probes
belong, and on the gRPC port. The attackers run on the same cores as the
server and the trainer, which a remote attacker would not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import framing
from grain_elevator.tools.testing.h2peer import H2Peer, flood

KINDS = ("grpc-unread", "bulk-unread", "bulk-idle", "oversize", "slowloris",
         "headers", "halfsent", "idlegrpc", "watch")
# Descriptors each attacker holds at most (its RLIMIT_NOFILE is raised to
# this plus a reserve).
NOFILE = {"grpc-unread": 0, "bulk-unread": 64, "bulk-idle": 2000, "oversize": 1,
          "slowloris": 200, "headers": 8, "halfsent": 20, "idlegrpc": 900, "watch": 130}
HEADER_CONNECTIONS = 8
HALFSENT_CONNECTIONS, HALFSENT_CALLS = 20, 20
IDLE_GRPC_CONNECTIONS = 900
WATCH_CONNECTIONS = 130
ELEVATOR = pb.DESCRIPTOR.services_by_name["Elevator"].full_name
DESCRIBE, GET_BATCHES = f"/{ELEVATOR}/Describe", f"/{ELEVATOR}/GetBatches"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
ENDLESS = pb.BatchRequest(dataset="generated", global_batch_size=128, shard_count=1,
                          start_step=0, num_steps=10**9)


# Hostile clients (each in a process of its own) ------------------------------

def _greeted(host: str, port: int, rcvbuf: int | None = None) -> socket.socket:
  s = socket.socket()
  if rcvbuf:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
  s.settimeout(10)
  s.connect((host, port))
  s.sendall(framing.MAGIC)
  return s


def _keep(n: int, make, seconds: float, period_s: float = 1.0) -> None:
  """Holds `n` things `make()` opens; replaces those that died, every period."""
  held: list[Any] = []
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    held = [h for h in held if h.alive()]
    while len(held) < n:
      try:
        held.append(make())
      except OSError:
        break
    time.sleep(period_s)


class _UnreadGrpc:
  def __init__(self, channel: grpc.Channel):
    self.call = pb_grpc.ElevatorStub(channel).GetBatches(ENDLESS, timeout=3600)

  def alive(self) -> bool:
    return not self.call.done()


class _Socket:
  """A hostile socket; dead once the server has closed it (a read says so)."""

  def __init__(self, sock: socket.socket):
    self.sock = sock
    sock.setblocking(False)

  def alive(self) -> bool:
    try:
      while True:
        if not self.sock.recv(1 << 20):
          self.sock.close()
          return False
    except BlockingIOError:
      return True
    except OSError:
      self.sock.close()
      return False


class _UnreadBulk(_Socket):
  """Reads nothing once asked: alive until the server cuts it (then it reads
  EOF after the buffered batches, which `alive` drains: a few MiB)."""

  def __init__(self, host: str, port: int):
    s = _greeted(host, port, rcvbuf=4096)
    s.sendall(framing.frame(framing.REQUEST,
                            pb.BulkRequest(request=ENDLESS).SerializeToString()))
    self.sock = s
    self.born = time.monotonic()

  def alive(self) -> bool:
    if time.monotonic() - self.born < 30:  # unread for 30 s, then checked
      return True
    self.sock.setblocking(False)
    return _Socket.alive(self)


def _oversize(host: str, port: int, seconds: float) -> None:
  deadline = time.monotonic() + seconds
  junk = b"\0" * (1 << 16)
  while time.monotonic() < deadline:
    s = None
    try:
      s = _greeted(host, port)
      s.sendall(framing.header(framing.REQUEST, 1 << 34))
      for _ in range(16):
        s.sendall(junk)
    except OSError:
      pass
    finally:
      if s is not None:
        s.close()


def _slowloris(host: str, port: int, seconds: float) -> None:
  socks = []
  for _ in range(200):
    try:
      socks.append(_greeted(host, port))
    except OSError:
      break
  header = framing.header(framing.REQUEST, 100)
  deadline = time.monotonic() + seconds
  for i in range(len(header)):
    if time.monotonic() > deadline:
      break
    for s in socks:
      try:
        s.send(header[i:i + 1])
      except OSError:
        pass
    time.sleep(2)
  while time.monotonic() < deadline:  # then hold them, the payload never sent
    time.sleep(1)


# Raw HTTP/2 peers (headers, halfsent, idlegrpc, watch) -----------------------

_HELD_AFTER_S = 0.5  # a call open this long was accepted, not refused


def _h2_calls(host: str, port: int, seconds: float, kind: str, *, connections: int,
              calls: int | None, methods: tuple[str, ...], declared_bytes: int | None = None,
              send_bytes: int = 0, period_s: float = 0.1) -> None:
  """Holds `connections` raw HTTP/2 connections, each carrying `calls`
  unfinished calls (None: as many as the server's stream limit allows),
  cycling over `methods`; every period, reopens the calls the server cut
  or refused and the connections it closed. Says what it held when it ends.
  (gRPC counts a call it cut against the stream limit until the worker has
  released it, refusing new ones meanwhile: its overload protection, on by
  default. "Held" counts the calls open long enough to have been accepted.)"""
  method = itertools.cycle(methods)
  held: list[H2Peer] = []
  gone: list[H2Peer] = []
  opened, samples = 0, []
  deadline = time.monotonic() + seconds
  try:
    while time.monotonic() < deadline:
      alive = []
      for p in held:
        (alive if p.alive() else gone).append(p)
      held = alive
      while len(held) < connections:
        try:
          held.append(H2Peer(host, port))
        except OSError:
          break
      for p in held:
        room = p.room() if calls is None else min(p.room(), calls - len(p.calls))
        for _ in range(max(0, room)):
          p.open_call(next(method), declared_bytes=declared_bytes, send_bytes=send_bytes)
          opened += 1
      now = time.monotonic()
      samples.append(sum(now - t > _HELD_AFTER_S for p in held for t in p.calls.values()))
      time.sleep(period_s)
  finally:
    cut = sum(p.cut for p in held + gone)
    refused = sum(p.refused for p in held + gone)
    line = (f"attacker {kind}: {len(held)} connections held, {len(gone)} closed by the "
            "server and reopened")
    if opened:
      line += (f"; {opened} calls opened, {cut} cut by the server, {refused} refused "
               f"(REFUSED_STREAM); calls held (open > {_HELD_AFTER_S} s): "
               f"mean {np.mean(samples):.0f}, max {max(samples)}")
    print(line, file=sys.stderr, flush=True)


def _raise_nofile(need: int) -> None:
  """Raises the soft RLIMIT_NOFILE to `need` where the hard limit allows."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft == resource.RLIM_INFINITY or soft >= need:
    return
  new = need if hard == resource.RLIM_INFINITY else min(need, hard)
  resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
  if new < need:
    print(f"attack: the open-files limit ({hard}) is below the {need} wanted; "
          "attackers hold fewer connections", file=sys.stderr)


def hostile(kind: str, target: str, bulk_port: int, seconds: float) -> None:
  host, port = target.rsplit(":", 1)
  _raise_nofile(NOFILE[kind] + 256)
  # Stopped by SIGTERM: unwind, so that an attacker can say what it held.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  if kind == "grpc-unread":
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    _keep(64, lambda: _UnreadGrpc(channel), seconds)
  elif kind == "bulk-unread":
    _keep(64, lambda: _UnreadBulk(host, bulk_port), seconds)
  elif kind == "bulk-idle":
    _keep(2000, lambda: _Socket(_greeted(host, bulk_port)), seconds, period_s=2.0)
  elif kind == "oversize":
    _oversize(host, bulk_port, seconds)
  elif kind == "slowloris":
    _slowloris(host, bulk_port, seconds)
  elif kind == "headers":
    _h2_calls(host, int(port), seconds, kind, connections=HEADER_CONNECTIONS, calls=None,
              methods=(DESCRIBE, GET_BATCHES, CHECK))
  elif kind == "halfsent":
    # pylint: disable-next=g-import-not-at-top
    from grain_elevator.proto.limits import MAX_REQUEST_BYTES
    declared = MAX_REQUEST_BYTES - 1024
    _h2_calls(host, int(port), seconds, kind, connections=HALFSENT_CONNECTIONS,
              calls=HALFSENT_CALLS, methods=(DESCRIBE,), declared_bytes=declared,
              send_bytes=declared - 1)
  elif kind == "idlegrpc":
    _h2_calls(host, int(port), seconds, kind, connections=IDLE_GRPC_CONNECTIONS, calls=0,
              methods=(), period_s=2.0)
  elif kind == "watch":  # each Watch's request: an empty HealthCheckRequest
    _h2_calls(host, int(port), seconds, kind, connections=WATCH_CONNECTIONS, calls=1,
              methods=(WATCH,), declared_bytes=0)


# The health port's floods (--health) -----------------------------------------

# name: (h2peer flood, connections/s, sources, held)
HEALTH_FLOODS: dict[str, tuple[str, float, tuple[str, ...], int]] = {
    "rapid-reset": ("rapid-reset", 125, ("127.0.0.2",), 0),
    "ping": ("ping", 0, ("127.0.0.2",), 0),
    "settings": ("settings", 0, ("127.0.0.2",), 0),
    "hpack": ("hpack", 125, ("127.0.0.2",), 0),
    "reset": ("reset", 250, ("127.0.0.2",), 0),
    "connect-many": ("connect", 500, tuple(f"127.0.1.{i}" for i in range(1, 201)), 256),
    "connect-same": ("connect", 500, ("127.0.0.1",), 16),
}
HEALTH_PROBE_PERIOD_S = 0.1


def health_flood(name: str, target: str, seconds: float) -> None:
  """One flood of HEALTH_FLOODS at the health port `target`; says what it did."""
  kind, rate, sources, held = HEALTH_FLOODS[name]
  host, port = target.rsplit(":", 1)
  _raise_nofile(held + 256)
  stats = flood(kind, host, int(port), seconds, rate=rate or 1.0, sources=sources,
                hold=held)
  print(f"flood {name}: {stats}", file=sys.stderr, flush=True)


def _health_phase(name: str, server, seconds: float) -> dict[str, Any]:
  """Probes the health port for `seconds` while flood `name` runs (none: "alone")."""
  attacker = None
  if name != "alone":
    attacker = subprocess.Popen([sys.executable, "-m", "grain_elevator.tools.bench.attack",
                                 "--health-flood", name, "--target", server.health_target,
                                 "--seconds", str(seconds + 2)])
    time.sleep(1)  # under way before the first probe
  supervisor = psutil.Process(server.proc.pid)
  cpu_before, wall_before = sum(supervisor.cpu_times()[:2]), time.monotonic()
  prober = subprocess.Popen(
      [sys.executable, "-m", "grain_elevator.tools.bench.attack", "--probe",
       "--health-target", server.health_target, "--period", str(HEALTH_PROBE_PERIOD_S)],
      stdout=subprocess.PIPE, text=True)
  time.sleep(seconds)
  prober.terminate()
  try:
    got = json.loads(prober.communicate(timeout=30)[0])["health_port"]
  except subprocess.TimeoutExpired:  # a probe's connection hangs past its deadline
    prober.kill()
    prober.communicate()
    got = [[None, False]]
  cpu = (sum(supervisor.cpu_times()[:2]) - cpu_before) / (time.monotonic() - wall_before)
  if attacker is not None:
    try:
      attacker.wait(30)
    except subprocess.TimeoutExpired:
      attacker.kill()
      attacker.wait()
  took = np.asarray([float("inf") if s is None else s for s, _ in got])
  return {"flood": name, "probes": len(took), "failed": sum(1 for s, ok in got if not ok),
          "p50_ms": float(np.median(took) * 1e3), "p99_ms": float(np.percentile(took, 99) * 1e3),
          "max_ms": float(took.max() * 1e3), "supervisor_cpu": cpu}


def health_bench(names: list[str], seconds: float) -> list[dict[str, Any]]:
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as root:
    config = demo.write_dataset(pathlib.Path(root), "generated").config
    with LocalServer(config, workers=1) as server:
      rows = [_health_phase(name, server, seconds) for name in ["alone", *names]]
  print(f"\n{'flood':<14}{'probes':>7}{'failed':>7}{'p50':>9}{'p99':>9}{'max':>9}"
        f"{'supervisor CPU':>16}")
  for r in rows:
    print(f"{r['flood']:<14}{r['probes']:>7}{r['failed']:>7}{r['p50_ms']:>7.1f}ms"
          f"{r['p99_ms']:>7.1f}ms{r['max_ms']:>7.1f}ms{r['supervisor_cpu'] * 100:>14.0f} %")
  return rows


# The trainer's side ---------------------------------------------------------

def _probe_health(target: str, stop: threading.Event,
                  out: list[tuple[float, bool]], period_s: float = 0.25) -> None:
  """(latency, SERVING?) of a Check every 0.25 s at `target`, each on a
  connection of its own; an error's latency is inf. The first, which pays
  for this process's gRPC start-up (a kubelet's is long running), is not
  counted."""
  warm_up: list[tuple[float, bool]] = []
  _probe_once(target, warm_up)
  while not stop.is_set():
    _probe_once(target, out)
    stop.wait(period_s)


def _probe_once(target: str, out: list[tuple[float, bool]]) -> None:
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    start = time.monotonic()
    try:
      reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=10)
      out.append((time.monotonic() - start,
                  reply.status == health_pb2.HealthCheckResponse.SERVING))
    except grpc.RpcError:
      out.append((float("inf"), False))


def probe(targets: dict[str, str], period_s: float = 0.25) -> None:
  """Probes each of `targets` (name: address) from a thread of its own until
  SIGTERM, then prints {name: [[latency, SERVING?], ...]} as JSON. A process
  apart from the trainer's, whose GIL would delay the probes it times."""
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  got: dict[str, list[tuple[float, bool]]] = {name: [] for name in targets}
  threads = [threading.Thread(target=_probe_health, args=(target, stop, got[name], period_s))
             for name, target in targets.items()]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  print(json.dumps({name: [[s if np.isfinite(s) else None, ok] for s, ok in out]
                    for name, out in got.items()}), flush=True)


def _sample_rss(server: psutil.Process, stop: threading.Event, out: list[float]) -> None:
  while not stop.is_set():
    total = 0
    try:
      children = server.children(recursive=True)
    except psutil.Error:  # one ended while listed
      continue
    for p in children:
      try:
        total += p.memory_info().rss
      except psutil.Error:
        pass
    out.append(total / 2**20)
    stop.wait(0.5)


def _read(target: str, config: str, steps: int) -> float:
  """Steps/s of a default client over `steps` steps, each checked exactly."""
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  with RemoteDataset(target, "generated", 128) as remote, \
       RemoteDataset.embedded(config, "generated", 128) as local:
    start = time.monotonic()
    for k, (got, want) in enumerate(zip(remote, local)):
      for name in want:
        if not np.array_equal(got[name], want[name]):
          raise AssertionError(f"step {k}: {name} differs from embedded mode")
      if k + 1 == steps:
        break
    return steps / (time.monotonic() - start)


def _phase(name: str, server, config: str, steps: int, kinds: list[str]) -> dict[str, Any]:
  hostiles = [subprocess.Popen([sys.executable, "-m", "grain_elevator.tools.bench.attack",
                                "--hostile", kind, "--target", server.target,
                                "--bulk-port", str(server.bulk_port), "--seconds", "600"])
              for kind in kinds]
  try:
    time.sleep(10 if kinds else 0)  # let them take every slot and socket
    stop = threading.Event()
    rss: list[float] = []
    sampler = threading.Thread(target=_sample_rss,
                               args=(psutil.Process(server.proc.pid), stop, rss))
    sampler.start()
    prober = subprocess.Popen(
        [sys.executable, "-m", "grain_elevator.tools.bench.attack", "--probe",
         "--target", server.target, "--health-target", server.health_target],
        stdout=subprocess.PIPE, text=True)
    rate = _read(server.target, config, steps)
    prober.terminate()
    probes = {port: [(float("inf") if s is None else s, ok) for s, ok in got]
              for port, got in json.loads(prober.communicate(timeout=60)[0]).items()}
    stop.set()
    sampler.join()
    gone = {kind: p.returncode for kind, p in zip(kinds, hostiles) if p.poll() is not None}
    if gone:  # the phase ran without them
      raise RuntimeError(f"attackers ended before their phase did (exit status): {gone}")
  finally:
    for p in hostiles:
      p.terminate()  # each says what it held
    for p in hostiles:
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  row: dict[str, Any] = {"phase": name, "steps_per_s": rate, "rss_max_mb": max(rss)}
  for port, health in probes.items():
    h = np.asarray([s for s, _ in health])
    not_serving = sum(1 for s, ok in health if not ok and not np.isinf(s))
    row[port] = {"p50_ms": float(np.median(h) * 1e3),
                 "p99_ms": float(np.percentile(h, 99) * 1e3),
                 "max_ms": float(h.max() * 1e3), "probes": len(h),
                 # an error or an answer other than SERVING, as a kubelet counts it
                 "failed": int(np.isinf(h).sum()) + not_serving, "not_serving": not_serving}
  return row


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--hostile", choices=KINDS, help=argparse.SUPPRESS)
  parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--target", help=argparse.SUPPRESS)
  parser.add_argument("--health-target", help=argparse.SUPPRESS)
  parser.add_argument("--bulk-port", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--seconds", type=float, default=600, help=argparse.SUPPRESS)
  parser.add_argument("--kinds", default=",".join(KINDS),
                      help=f"attackers, comma-separated (default: all of {', '.join(KINDS)})")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--health", action="store_true",
                      help="the health port's floods instead (see above)")
  parser.add_argument("--floods", default=",".join(HEALTH_FLOODS),
                      help="with --health: which, comma-separated (default: all)")
  parser.add_argument("--flood-seconds", type=float, default=8.0,
                      help="with --health: how long each flood lasts")
  parser.add_argument("--health-flood", choices=sorted(HEALTH_FLOODS), help=argparse.SUPPRESS)
  parser.add_argument("--period", type=float, default=0.25, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.hostile:
    hostile(args.hostile, args.target, args.bulk_port, args.seconds)
    return 0
  if args.health_flood:
    health_flood(args.health_flood, args.target, args.seconds)
    return 0
  if args.probe:
    targets = {"health_port": args.health_target}
    if args.target:
      targets["grpc_port"] = args.target
    probe(targets, args.period)
    return 0
  if args.health:
    names = args.floods.split(",")
    if not set(names) <= set(HEALTH_FLOODS):
      parser.error(f"--floods: unknown {sorted(set(names) - set(HEALTH_FLOODS))}")
    rows = health_bench(names, args.flood_seconds)
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
  kinds = args.kinds.split(",")
  if not set(kinds) <= set(KINDS):
    parser.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; choose from {KINDS}")
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as root:
    config = demo.write_dataset(pathlib.Path(root), "generated").config
    with LocalServer(config, workers=args.workers) as server:
      rows = [_phase("alone", server, config, args.steps, [])]
      for kind in kinds:
        rows.append(_phase(kind, server, config, args.steps, [kind]))
      if len(kinds) > 1:
        rows.append(_phase("all at once", server, config, args.steps, kinds))
      restarts = server.stderr().count("restarting it")
  base = rows[0]["steps_per_s"]
  print(f"\n{'':<32}{'health port':^30}{'gRPC port':^30}")
  probe_columns = f"{'p50':>8}{'p99':>8}{'max':>8}{'(failed)':>9}"
  print(f"{'attack':<14}{'steps/s':>9}{'x alone':>9}{probe_columns:>30}{probe_columns:>30}"
        f"{'worker RSS max':>16}")
  for r in rows:
    probed = "".join(
        f"{p['p50_ms']:>6.1f}ms{p['p99_ms']:>6.1f}ms{p['max_ms']:>6.1f}ms"
        f"{p['probes']:>4} ({p['failed']})".rjust(30)
        for p in (r["health_port"], r["grpc_port"]))
    print(f"{r['phase']:<14}{r['steps_per_s']:>9.1f}{r['steps_per_s'] / base:>9.2f}"
          f"{probed}{r['rss_max_mb']:>13.0f} MB")
  print(f"every batch matched embedded mode; worker restarts: {restarts}; "
        f"attackers: {', '.join(kinds)}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "restarts": restarts},
                                                  indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
