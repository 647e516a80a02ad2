"""One worker process: a gRPC server over the datasets of a config.

Several workers bind the same port (SO_REUSEPORT); the kernel spreads client
connections across them. Each is stateless, so any of them serves any step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import signal
import sys
import threading
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from grain_elevator.server import auth
from grain_elevator.server import bulk as bulk_lib
from grain_elevator.server import config as config_lib
from grain_elevator.server import dataset as dataset_lib
from grain_elevator.server import logs
from grain_elevator.server.errors import ConfigError
from grain_elevator.server import servicer as servicer_lib

SERVICE_NAME = servicer_lib.SERVICE_NAME


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
  config_path: str
  host: str
  port: int
  threads: int = 4  # RPCs one worker runs at once
  grace_s: float = 5.0  # in-flight RPCs get this long on SIGTERM
  num_workers: int = 1  # processes sharing the port (reported in Describe)
  max_concurrent_rpcs: int = 16  # beyond: RESOURCE_EXHAUSTED, clients back off
  max_message_bytes: int = dataset_lib.DEFAULT_MAX_BATCH_BYTES
  tls_cert: str | None = None
  tls_key: str | None = None
  tls_client_ca: str | None = None  # mutual TLS when set
  auth_token_file: str | None = None
  # The bulk transport's port (server/bulk.py); None: not offered. The
  # supervisor turns 0 into one free port that all workers share.
  bulk_port: int | None = None


def _die_with_parent() -> None:
  """Linux: get SIGTERM if the supervisor dies, so no worker is orphaned."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
      pass


@dataclasses.dataclass
class Servers:
  grpc: grpc.Server
  health: health.HealthServicer
  port: int
  bulk: bulk_lib.BulkServer | None


def build_server(datasets: dict[str, dataset_lib.ElevatorDataset],
                 opts: WorkerOptions, index: int = 0) -> Servers:
  """Start-able gRPC (Elevator, health, reflection) and bulk servers."""
  token = auth.read_token(opts.auth_token_file) if opts.auth_token_file else None
  interceptors = [auth.BearerTokenInterceptor(token)] if token else []
  server = grpc.server(
      futures.ThreadPoolExecutor(max_workers=opts.threads,
                                 thread_name_prefix="elevator-rpc"),
      interceptors=interceptors,
      maximum_concurrent_rpcs=opts.max_concurrent_rpcs,
      options=[
          ("grpc.so_reuseport", 1),
          ("grpc.max_send_message_length", -1),
          ("grpc.max_receive_message_length", 1 << 20),  # requests are tiny
      ])
  servicer = servicer_lib.ElevatorServicer(datasets, index, opts.num_workers)
  bulk_server = None
  if opts.bulk_port is not None:
    bulk_server = bulk_lib.BulkServer(
        servicer, opts.host, opts.bulk_port,
        auth_token=token,
        max_concurrent_requests=opts.max_concurrent_rpcs)
    servicer.set_bulk_port(bulk_server.port)
  servicer_lib.add_to_server(servicer, server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  reflection.enable_server_reflection(
      (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
  address = f"{opts.host}:{opts.port}"
  if opts.tls_cert:
    port = server.add_secure_port(address, auth.server_credentials(
        opts.tls_cert, opts.tls_key, opts.tls_client_ca))
  else:
    port = server.add_insecure_port(address)
  return Servers(server, health_servicer, port, bulk_server)


def run(opts: WorkerOptions, index: int, ready: Any) -> None:
  """Worker process entry point; reports (index, error or None) on `ready`."""
  _die_with_parent()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # The supervisor handles Ctrl-C.
  logs.setup(f"elevator[worker {index}]")
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  try:
    datasets = dataset_lib.load_datasets(config_lib.load_config(opts.config_path),
                                         opts.max_message_bytes)
    servers = build_server(datasets, opts, index)
    if servers.port == 0:
      raise OSError(f"cannot listen on {opts.host}:{opts.port}")
  except (ConfigError, OSError) as e:
    ready.put((index, str(e)))
    return
  servers.grpc.start()
  if servers.bulk:
    servers.bulk.start()
  for service in ("", SERVICE_NAME):
    servers.health.set(service, health_pb2.HealthCheckResponse.SERVING)
  ready.put((index, None))
  stop.wait()
  servers.health.enter_graceful_shutdown()
  stopped = servers.grpc.stop(opts.grace_s)
  if servers.bulk:
    servers.bulk.stop(opts.grace_s)
  stopped.wait()
