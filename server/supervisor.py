"""`elevator serve`: start N worker processes on one port and keep them alive.

The supervisor validates the config, starts the workers, restarts any that
die (logging why), and on SIGINT/SIGTERM stops them all and exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import socket
import threading
import time

from grain_elevator.server import config as config_lib
from grain_elevator.server import worker as worker_lib
from grain_elevator.server import auth
from grain_elevator.server.errors import ConfigError, ElevatorError

log = logging.getLogger("grain_elevator.server")

_START_TIMEOUT_S = 120.0

# glibc returns big buffers to the OS on free and page-faults them back on the
# next batch; keeping them nearly doubles gRPC throughput and cuts the cost of
# encoding a 3 MB batch from ~8 ms to ~0.6 ms (DESIGN.md §3, BENCHMARKS.md).
# numpy madvises arrays of 4 MiB and up as transparent huge pages; each new
# multi-megabyte batch then faults in and zeroes fresh 2 MiB pages, ~20% of a
# worker's CPU samples on the large bench workload (perf), ~2% without.
# Workers inherit these unless the operator set them.
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
    "NUMPY_MADVISE_HUGEPAGE": "0",
}


class StartError(ElevatorError):
  """The workers could not start (bad dataset, port in use)."""


def _reserve_port(host: str, port: int) -> socket.socket:
  """Binds (not listens) with SO_REUSEPORT, so port 0 becomes a fixed port
  that the workers can share and nobody else takes meanwhile."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise StartError(f"cannot bind {host}:{port}: {e.strerror}") from e
  return sock


class Supervisor:
  """Owns the worker processes of one `elevator serve`."""

  def __init__(self, opts: worker_lib.WorkerOptions, num_workers: int):
    self._opts = dataclasses.replace(opts, num_workers=num_workers)
    self._num_workers = num_workers
    self._ctx = mp.get_context("spawn")
    self._ready = self._ctx.Queue()
    self._procs: dict[int, mp.process.BaseProcess] = {}
    self._stop = threading.Event()

  def _spawn(self, index: int) -> None:
    p = self._ctx.Process(target=worker_lib.run, args=(self._opts, index, self._ready),
                          name=f"elevator-worker-{index}", daemon=True)
    p.start()
    self._procs[index] = p

  def _await_ready(self, indices: set[int]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    pending = set(indices)
    while pending:
      try:
        index, error = self._ready.get(timeout=0.2)
      except queue.Empty:
        for i in pending:
          if not self._procs[i].is_alive():
            raise StartError(
                f"worker {i} exited with code {self._procs[i].exitcode} while starting")
        if time.monotonic() > deadline:
          raise StartError(f"workers {sorted(pending)} did not start within "
                           f"{_START_TIMEOUT_S:.0f}s")
        continue
      if error is not None:
        raise StartError(error)
      pending.discard(index)

  def start(self) -> int:
    """Starts every worker; returns the port they serve on."""
    reservation = _reserve_port(self._opts.host, self._opts.port)
    bulk_reservation = None
    try:
      self._opts = dataclasses.replace(self._opts, port=reservation.getsockname()[1])
      if self._opts.bulk_port is not None:
        bulk_reservation = _reserve_port(self._opts.host, self._opts.bulk_port)
        self._opts = dataclasses.replace(
            self._opts, bulk_port=bulk_reservation.getsockname()[1])
      for i in range(self._num_workers):
        self._spawn(i)
      self._await_ready(set(range(self._num_workers)))
    except BaseException:
      self.stop()
      raise
    finally:
      reservation.close()
      if bulk_reservation:
        bulk_reservation.close()
    return self._opts.port

  @property
  def bulk_port(self) -> int | None:
    return self._opts.bulk_port

  def supervise(self) -> None:
    """Restarts dead workers until `request_stop`."""
    while not self._stop.is_set():
      sentinels = {p.sentinel: i for i, p in self._procs.items()}
      for sentinel in mp.connection.wait(list(sentinels), timeout=0.5):
        if self._stop.is_set():
          break
        i = sentinels[sentinel]
        self._procs[i].join()
        code = self._procs[i].exitcode
        why = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
               else f"exited with code {code}")
        log.warning("worker %d (pid %s) %s; restarting it", i, self._procs[i].pid, why)
        self._spawn(i)
        try:
          self._await_ready({i})
        except StartError as e:
          log.error("worker %d failed to restart: %s", i, e)

  def request_stop(self, *_: object) -> None:
    self._stop.set()

  def stop(self) -> None:
    """SIGTERM every worker, wait out their grace period, then SIGKILL."""
    self._stop.set()
    for p in self._procs.values():
      if p.is_alive():
        p.terminate()
    deadline = time.monotonic() + self._opts.grace_s + 5.0
    for p in self._procs.values():
      p.join(max(0.0, deadline - time.monotonic()))
      if p.is_alive():
        p.kill()
        p.join()


def serve(opts: worker_lib.WorkerOptions, num_workers: int | None = None) -> int:
  """Runs a server until SIGINT/SIGTERM; returns the process exit code."""
  num_workers = num_workers or os.cpu_count() or 1
  config = config_lib.load_config(opts.config_path)  # Fail fast on a bad file.
  if bool(opts.tls_cert) != bool(opts.tls_key):
    raise ConfigError("--tls-cert and --tls-key go together")
  if opts.tls_client_ca and not opts.tls_cert:
    raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
  if opts.tls_cert:
    auth.server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)  # readable?
  if opts.auth_token_file:
    auth.read_token(opts.auth_token_file)
  for key, value in WORKER_ENV.items():
    os.environ.setdefault(key, value)  # read by each spawned worker's glibc and numpy
  sup = Supervisor(opts, num_workers)
  signal.signal(signal.SIGTERM, sup.request_stop)
  signal.signal(signal.SIGINT, sup.request_stop)
  port = sup.start()
  names = ", ".join(sorted(config.datasets))
  bulk = f", bulk port {sup.bulk_port}" if sup.bulk_port is not None else ""
  print(f"elevator: serving [{names}] on {opts.host}:{port} with {num_workers} "
        f"worker processes{bulk} (pid {os.getpid()})", flush=True)
  try:
    sup.supervise()
  finally:
    sup.stop()
  print("elevator: stopped", flush=True)
  return 0
