"""The service under attack: what a well-behaved trainer sees, side by side.

    python -m grain_elevator.tools.bench.attack [--steps 3000] [--workers 2]

Serves a small image dataset with DEFAULT options and reads it with a
DEFAULT client: alone, while each kind of hostile client runs (a process of
its own, so it shares no GIL with the trainer), then while all of them run.
They do what server/admission.py and server/bulk.py defend against:

  grpc-unread   64 GetBatches streams of an endless stream, never read;
                each one cut is opened again at once
  bulk-unread   64 bulk connections asking for an endless stream, with a
                4 KiB receive buffer, never read; reopened when cut
  bulk-idle     2,000 greeted bulk connections that send nothing (past the
                1,024 cap per worker); reopened when closed
  oversize      connections promising a 2**34-byte request, then junk
  slowloris     200 connections sending a request header a byte every 2 s

Every run checks each batch against embedded mode (bit for bit) and reports
steps/s, the health check's latency (a fresh connection every 0.25 s, as a
kubelet probe makes) and the workers' peak RSS. The attackers run on the
same cores as the server and the trainer, which a remote attacker would not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
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

KINDS = ("grpc-unread", "bulk-unread", "bulk-idle", "oversize", "slowloris")
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
    try:
      s = _greeted(host, port)
      s.sendall(framing.header(framing.REQUEST, 1 << 34))
      for _ in range(16):
        s.sendall(junk)
    except OSError:
      pass
    finally:
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


def hostile(kind: str, target: str, bulk_port: int, seconds: float) -> None:
  host = target.rsplit(":", 1)[0]
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
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
  del soft


# The trainer's side ---------------------------------------------------------

def _probe_health(target: str, stop: threading.Event, out: list[float]) -> None:
  while not stop.is_set():
    with grpc.insecure_channel(target,
                               options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
      start = time.monotonic()
      try:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        out.append(time.monotonic() - start)
      except grpc.RpcError:
        out.append(float("inf"))
    stop.wait(0.25)


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
  hostiles = [subprocess.Popen([sys.executable, "-m", "grain_elevator.tools.bench.attack", "--hostile", kind,
                                "--target", server.target,
                                "--bulk-port", str(server.bulk_port), "--seconds", "600"])
              for kind in kinds]
  try:
    time.sleep(10 if kinds else 0)  # let them take every slot and socket
    stop = threading.Event()
    health: list[float] = []
    rss: list[float] = []
    threads = [threading.Thread(target=_probe_health, args=(server.target, stop, health)),
               threading.Thread(target=_sample_rss,
                                args=(psutil.Process(server.proc.pid), stop, rss))]
    for t in threads:
      t.start()
    rate = _read(server.target, config, steps)
    stop.set()
    for t in threads:
      t.join()
  finally:
    for p in hostiles:
      p.kill()
      p.wait()
  h = np.asarray(health)
  return {"phase": name, "steps_per_s": rate, "health_p50_ms": float(np.median(h) * 1e3),
          "health_max_ms": float(h.max() * 1e3), "health_probes": len(h),
          "health_failed": int(np.isinf(h).sum()), "rss_max_mb": max(rss)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--hostile", choices=KINDS, help=argparse.SUPPRESS)
  parser.add_argument("--target", help=argparse.SUPPRESS)
  parser.add_argument("--bulk-port", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--seconds", type=float, default=600, help=argparse.SUPPRESS)
  parser.add_argument("--kinds", default=",".join(KINDS),
                      help=f"attackers, comma-separated (default: all of {', '.join(KINDS)})")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args()
  if args.hostile:
    hostile(args.hostile, args.target, args.bulk_port, args.seconds)
    return 0
  kinds = args.kinds.split(",")
  if not set(kinds) <= set(KINDS):
    parser.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; choose from {KINDS}")
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.launcher import LocalServer  # pylint: disable=g-import-not-at-top
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
  print(f"\n{'attack':<14}{'steps/s':>9}{'x alone':>9}{'health p50':>12}{'health max':>12}"
        f"{'probes (failed)':>17}{'worker RSS max':>16}")
  for r in rows:
    print(f"{r['phase']:<14}{r['steps_per_s']:>9.1f}{r['steps_per_s'] / base:>9.2f}"
          f"{r['health_p50_ms']:>10.1f}ms{r['health_max_ms']:>10.1f}ms"
          f"{r['health_probes']:>11} ({r['health_failed']})"
          f"{r['rss_max_mb']:>13.0f} MB")
  print(f"every batch matched embedded mode; worker restarts: {restarts}; "
        f"attackers: {', '.join(kinds)}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "restarts": restarts},
                                                  indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
