"""One worker process: the request path behind a gRPC and a bulk server.

Several workers bind the same ports (SO_REUSEPORT); the kernel spreads client
connections across them. Each is stateless, so any of them serves any step.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import ElevatorError
from grain_elevator.server import auth
from grain_elevator.server import bulk as bulk_lib
from grain_elevator.server import config as config_lib
from grain_elevator.server import dataset as dataset_lib
from grain_elevator.server import grpc_service
from grain_elevator.server import lifeline
from grain_elevator.server import logs
from grain_elevator.server import metrics
from grain_elevator.server import shard_identity
from grain_elevator.server.options import HEALTH_THREADS, ServerOptions
from grain_elevator.server.request_path import MAX_REQUEST_BYTES, RequestPath


class _OnOwnThreads:
  """The health service with its own threads (gRPC's per-method pools): a
  probe is answered while every request thread is busy. Watch streams last,
  so they get a pool apart from Check's."""

  def __init__(self, servicer: health.HealthServicer):
    check_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health")
    watch_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health-watch")
    for name, pool in (("Check", check_pool), ("List", check_pool), ("Watch", watch_pool)):
      method = getattr(servicer, name)

      def call(request: Any, context: grpc.ServicerContext, _method=method) -> Any:
        return _method(request, context)
      call.experimental_thread_pool = pool  # type: ignore[attr-defined]
      setattr(self, name, call)


@dataclasses.dataclass
class Servers:
  """What one worker serves: its request path and the transports around it."""
  path: RequestPath
  grpc: grpc.Server
  health: health.HealthServicer
  port: int
  bulk: bulk_lib.BulkServer | None

  def start(self) -> None:
    self.grpc.start()
    if self.bulk:
      self.bulk.start()
    for service in ("", grpc_service.SERVICE_NAME):
      self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

  def stop(self, grace_s: float) -> None:
    """Health NOT_SERVING, new requests refused, those in flight get `grace_s`."""
    self.health.enter_graceful_shutdown()
    self.path.admission.close()
    stopped = self.grpc.stop(grace_s)
    if self.bulk:
      self.bulk.stop(grace_s)
    stopped.wait()


def build_servers(datasets: dataset_lib.Datasets, opts: ServerOptions, index: int = 0,
                  num_workers: int = 1) -> Servers:
  """Start-able gRPC (Elevator, health, reflection) and bulk servers."""
  token = auth.read_token(opts.auth_token_file) if opts.auth_token_file else None
  path = RequestPath(datasets, auth_token=token,
                     max_concurrent=opts.max_concurrent_requests,
                     max_message_bytes=opts.max_message_bytes,
                     write_timeout_s=opts.write_timeout_s,
                     server_info=pb.ServerInfo(worker_index=index, num_workers=num_workers),
                     batch_cache_bytes=opts.batch_cache_bytes // max(1, num_workers))
  server = grpc.server(
      futures.ThreadPoolExecutor(max_workers=opts.grpc_threads,
                                 thread_name_prefix="elevator-rpc"),
      interceptors=[grpc_service.AuthInterceptor(path)] if token else [],
      # No maximum_concurrent_rpcs: gRPC would refuse health checks with it.
      # Admission bounds the requests (server/admission.py), and threads
      # beyond its slots keep Describe from queueing behind them.
      options=[
          ("grpc.so_reuseport", 1),
          ("grpc.max_send_message_length", -1),
          ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
          ("grpc.max_connection_idle_ms", int(opts.idle_timeout_s * 1000)),
      ])
  bulk_server = None
  if opts.serves_bulk:
    bulk_server = bulk_lib.BulkServer(path, opts.host, opts.bulk_port,
                                      idle_timeout_s=opts.idle_timeout_s,
                                      max_connections=opts.max_bulk_connections,
                                      threads=opts.max_concurrent_requests)
    path.server_info.bulk_port = bulk_server.port
  grpc_service.add_to_server(grpc_service.GrpcService(path), server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(_OnOwnThreads(health_servicer), server)
  reflection.enable_server_reflection(
      (grpc_service.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
  address = f"{opts.host}:{opts.port}"
  if opts.tls:
    port = server.add_secure_port(address, auth.server_credentials(
        opts.tls_cert, opts.tls_key, opts.tls_client_ca))
  else:
    port = server.add_insecure_port(address)
  return Servers(path, server, health_servicer, port, bulk_server)


def run(config_path: str, opts: ServerOptions, index: int, num_workers: int,
        ready: Any, identities: dict[str, shard_identity.ShardIdentity] | None = None,
        *, supervisor_pid: int | None = None, crash_loop: Any = None,
        last_request: Any = None) -> None:
  """Worker process entry point; reports (index, error or None) on `ready`.
  `identities`: the shards as the supervisor recorded them at start-up.
  `supervisor_pid`: the parent it must not outlive (lifeline.py).
  `crash_loop`: a restarts.CrashLoopFlag; health is NOT_SERVING while it is on.
  `last_request`: a shared double this worker sets to time.monotonic() on
  every admitted request (the supervisor's `--idle-exit-s`)."""
  lifeline.tie(supervisor_pid)  # again, for a worker spawned with `run` as its target
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # The supervisor handles Ctrl-C.
  logs.setup(f"elevator[worker {index}]")
  metrics.start_recording()  # when the supervisor serves metrics
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  try:
    datasets = dataset_lib.Datasets(config_lib.load_config(config_path), identities=identities)
    # Loading takes seconds, and the supervisor's death (or stop) while it ran
    # only set `stop`: bind no port for a server that is gone.
    if stop.is_set() or lifeline.orphaned(supervisor_pid):
      return
    servers = build_servers(datasets, opts, index, num_workers)
    if servers.port == 0:
      raise OSError(f"cannot listen on {opts.host}:{opts.port}")
  except (ElevatorError, OSError) as e:
    ready.put((index, str(e)))
    return
  if last_request is not None:
    def note_request() -> None:
      last_request.value = time.monotonic()
    servers.path.admission.on_admit = note_request
  servers.start()
  if crash_loop is not None:
    def show(looping: bool) -> None:
      status = (health_pb2.HealthCheckResponse.NOT_SERVING if looping
                else health_pb2.HealthCheckResponse.SERVING)
      for service in ("", grpc_service.SERVICE_NAME):
        servers.health.set(service, status)
    crash_loop.watch(show, stop)
  ready.put((index, None))
  stop.wait()
  servers.stop(opts.grace_s)
