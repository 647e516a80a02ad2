"""One worker process: the request path behind a gRPC and a bulk server.

Several workers bind the same ports (SO_REUSEPORT); the kernel spreads client
connections across them. Each is stateless, so any of them serves any step.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import signal
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import ElevatorError
from grain_elevator.proto.limits import MAX_REQUEST_BYTES
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import registry
from grain_elevator.server.data.shards import identity as shard_identity
from grain_elevator.server.data.storage import objects as storage_objects
from grain_elevator.server.data.storage import cache as object_cache
from grain_elevator.server.data.storage import cache_fill
from grain_elevator.server.data.storage import read_ahead
from grain_elevator.server.data.streams import parallel_head
from grain_elevator.server.data.streams.stream import StreamDataset
from grain_elevator.server.data.streams.sub_streams import SubStreams
from grain_elevator.server.process import descriptors
from grain_elevator.server.process import lifeline
from grain_elevator.server.process import logs
from grain_elevator.server.serving.options import ServerOptions
from grain_elevator.server.serving import auth
from grain_elevator.server.serving import bulk as bulk_lib
from grain_elevator.server.serving import grpc_service
from grain_elevator.server.serving import health as health_lib
from grain_elevator.server.serving import metrics
from grain_elevator.server.serving.bulk import HANDSHAKE_TIMEOUT_S
from grain_elevator.server.serving.request_path import RequestPath
from grain_elevator.server.serving import step_errors


# Reflection streams stay open as long as their client likes: they get
# threads of their own, so they cannot hold the request threads.
REFLECTION_THREADS = 2


@dataclasses.dataclass
class Servers:
  """What one worker serves: its request path and the transports around it."""
  path: RequestPath
  grpc: grpc.Server
  health: health_lib.Health
  port: int
  bulk: bulk_lib.BulkServer | None
  threads: futures.ThreadPoolExecutor  # gRPC's request threads

  def start(self) -> None:
    self.grpc.start()
    if self.bulk:
      self.bulk.start()
    self.health.publish()
    self.health.watch_pool(self.threads)

  def stop(self, grace_s: float) -> None:
    """Health NOT_SERVING, new requests refused, those in flight get `grace_s`."""
    self.health.stop()
    self.path.admission.close()
    logging.getLogger("grain_elevator.server").info(
        "stopping: new requests are refused, those in flight get %gs", grace_s)
    stopped = self.grpc.stop(grace_s)
    if self.bulk:
      self.bulk.stop(grace_s)
    stopped.wait()


def build_servers(datasets: registry.Datasets, opts: ServerOptions, index: int = 0,
                  num_workers: int = 1,
                  report: health_lib.WorkerReport | None = None) -> Servers:
  """Start-able gRPC (Elevator, health, reflection) and bulk servers;
  `report`: where the worker's health is seen from the health port."""
  budget = descriptors.Budget(
      bulk_connections=opts.max_bulk_connections if opts.serves_bulk else 0,
      grpc_connections=opts.max_grpc_connections, shards=datasets.num_shards)
  descriptors.secure(budget)
  if index == 0:
    logging.getLogger("grain_elevator.server").info("each worker may hold %s", budget)
  token = auth.read_token(opts.auth_token_file) if opts.auth_token_file else None
  storage_objects.set_counts(metrics.current())
  read_ahead.configure(opts.read_ahead_mb << 20, metrics.current())
  if opts.cache_dir:
    cache = object_cache.open_cache(opts.cache_dir, opts.cache_mb, metrics.current())
    cache_fill.start(cache, index, num_workers)
  path = RequestPath(datasets, auth_token=token,
                     max_concurrent=opts.max_concurrent_requests,
                     max_message_bytes=opts.max_message_bytes,
                     max_stream_batch_bytes=opts.max_stream_batch_bytes,
                     write_timeout_s=opts.write_timeout_s,
                     server_info=pb.ServerInfo(worker_index=index, num_workers=num_workers),
                     batch_cache_bytes=opts.batch_cache_bytes // max(1, num_workers))
  threads = futures.ThreadPoolExecutor(max_workers=opts.grpc_threads,
                                       thread_name_prefix="elevator-rpc")
  reflection_pool = futures.ThreadPoolExecutor(REFLECTION_THREADS, "elevator-reflection")
  # With a token, a connection that makes no call with it is closed soon
  # (its front door, server/serving/front_door.py).
  token_check = grpc_service.AuthInterceptor(path) if token else None
  arrivals = grpc_service.ArrivalInterceptor(
      grpc_service.Arrivals(), {f"/{reflection.SERVICE_NAME}/": reflection_pool})
  server = grpc.server(
      threads,
      interceptors=[arrivals, *([token_check] if token_check else [])],
      # No maximum_concurrent_rpcs: gRPC would refuse health checks with it.
      # Admission bounds the requests (server/serving/admission.py), and threads
      # beyond its slots keep Describe from queueing behind them.
      options=[
          ("grpc.so_reuseport", 1),
          ("grpc.max_send_message_length", -1),
          ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
          ("grpc.max_connection_idle_ms", int(opts.idle_timeout_s * 1000)),
          ("grpc.max_allowed_incoming_connections", opts.max_grpc_connections),
          ("grpc.max_concurrent_streams", opts.max_streams_per_connection),
          ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
          # Flow control by the message, not by measured bandwidth: with BDP
          # probing, each call whose request is still arriving was granted
          # ~1 MB of window and 400 of them held 297 MB (26 MB without;
          # tests/server/serving/test_grpc_hardening.py). The worker receives only small
          # requests; what it sends is paced by the client's window.
          ("grpc.http2.bdp_probe", 0),
      ])
  bulk_server = None
  if opts.serves_bulk:
    bulk_server = bulk_lib.BulkServer(path, opts.host, opts.bulk_port,
                                      idle_timeout_s=opts.idle_timeout_s,
                                      max_connections=opts.max_bulk_connections,
                                      max_per_peer=opts.max_bulk_connections_per_peer,
                                      threads=opts.max_concurrent_requests)
    path.server_info.bulk_port = bulk_server.port
  grpc_service.add_to_server(grpc_service.GrpcService(path), server)
  # With a token, a health call reaches the service only with it (the
  # AuthInterceptor); without one, nobody has it.
  health = health_lib.Health(("", grpc_service.SERVICE_NAME), watch_s=opts.idle_timeout_s,
                             trusted=lambda _: token is not None, report=report)
  health.add_to_server(server)
  reflection.enable_server_reflection(
      (grpc_service.SERVICE_NAME, health_lib.SERVICE_NAME, reflection.SERVICE_NAME),
      server)
  address = f"{opts.host}:{opts.port}"
  if opts.tls:
    port = server.add_secure_port(address, auth.server_credentials(
        opts.tls_cert, opts.tls_key, opts.tls_client_ca))
  else:
    port = server.add_insecure_port(address)
  if token_check is not None and port:
    token_check.door.start(port)
  return Servers(path, server, health, port, bulk_server, threads)


def _report(ready: Any, report: tuple[int, str | None]) -> None:
  """Tells the supervisor how the start went; a supervisor gone meanwhile
  (the pipe broken) hears nothing, and the lifeline stops this worker."""
  try:
    ready.send(report)
    ready.close()
  except OSError:
    pass


# The file faulthandler writes to, held open for the worker's life.
_crash_report: Any = None


def _report_crashes(path: str | None) -> None:
  """Every thread's stack to `path` on a fatal signal (faulthandler), the
  crashing thread's marked "Current thread": the supervisor blames the step
  it was making (supervisor._blame). Without a file, nothing is written."""
  global _crash_report
  if path is None:
    return
  try:
    _crash_report = open(path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
  except OSError as e:
    logging.getLogger("grain_elevator.server").warning(
        "no crash report (%s): a step that kills this worker is found only when it "
        "was the only one in flight", e)
    return
  faulthandler.enable(file=_crash_report, all_threads=True)


def run(config_path: str, opts: ServerOptions, index: int, num_workers: int,
        ready: Any, identities: shard_identity.Recorded | None = None,
        *, supervisor_pid: int | None = None, crash_loop: Any = None,
        last_request: Any = None, head_peers: Any = None,
        health_slot: health_lib.WorkerReport | None = None, step_slot: Any = None,
        crash_file: str | None = None) -> None:
  """Worker process entry point; reports (index, error or None) on `ready`,
  the write end of a pipe of its own (supervisor.py).
  `identities`: the shards and option files as the supervisor recorded them
  at start-up.
  `supervisor_pid`: the parent it must not outlive (lifeline.py).
  `crash_loop`: a restarts.CrashLoopFlag; health is NOT_SERVING while it is on.
  `last_request`: a shared double this worker sets to inf while it has a
  request in flight and to time.monotonic() when its last one ends (the
  supervisor's `--idle-exit-s`).
  `head_peers`: the head_sockets.HeadPeers where the server's workers meet
  to compute its stream datasets' heads together (None: one worker).
  `health_slot`: where this worker's health is seen from the health port
  (health_board.WorkerSlot).
  `step_slot`: where this worker notes the steps it makes, and learns those
  that killed a worker (step_board.WorkerSteps).
  `crash_file`: where faulthandler writes every thread's stack on a fatal
  signal, for the supervisor to find the step that caused it."""
  lifeline.tie(supervisor_pid)  # again, for a worker spawned with `run` as its target
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # The supervisor handles Ctrl-C.
  logs.setup(f"elevator[worker {index}]")
  metrics.start_recording()  # when the supervisor serves metrics
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  _report_crashes(crash_file)
  if step_slot is not None:
    step_errors.use_board(step_slot)
  try:
    datasets = registry.Datasets(config_lib.load_config(config_path), identities=identities)
    # Loading takes seconds, and the supervisor's death (or stop) while it ran
    # only set `stop`: bind no port for a server that is gone.
    if stop.is_set() or lifeline.orphaned(supervisor_pid):
      return
    servers = build_servers(datasets, opts, index, num_workers, health_slot)
    if servers.port == 0:
      raise OSError(f"cannot listen on {opts.host}:{opts.port}")
    heads = None
    if head_peers is not None:
      heads = parallel_head.HeadService(head_peers, index, datasets, metrics.current())
      for name, ds in datasets.opened().items():  # not those refused
        for part in (ds.parts if isinstance(ds, SubStreams)
                     else [ds] if isinstance(ds, StreamDataset) else []):
          part.use_head(heads.factory(name, part.info.config_fingerprint),
                        elements_held=heads.elements_held)
  except (ElevatorError, OSError) as e:
    _report(ready, (index, str(e)))
    return
  if last_request is not None:
    def note_in_flight(requests: int) -> None:  # busy (inf) until the last one ends
      last_request.value = float("inf") if requests else time.monotonic()
    servers.path.admission.on_in_flight = note_in_flight
  servers.start()
  if crash_loop is not None:
    crash_loop.watch(lambda looping: servers.health.set_reason("crash loop", looping), stop)
  if health_slot is not None:
    health_slot.beat()  # serving before it says so: health counts it at once
  _report(ready, (index, None))
  stop.wait()
  servers.stop(opts.grace_s)
  if heads is not None:
    heads.stop()
