"""The health service of one worker, and what it reports.

Probes (kubelet, load balancers) need no token and are never admitted or
limited, so the service runs on threads of its own: a probe is answered
while every request thread is busy. Its methods read their request as a stream,
under the arrival deadline (server/serving/grpc_service.py), so header-only calls
cannot hold the probes' threads either. Watch streams last, so they get a pool apart.

SERVING means the worker can serve a Describe now: `Health` turns NOT_SERVING
while the worker's crash-loop flag is on (server/process/restarts.py) or while its
request threads cannot start a task within PROBE_TIMEOUT_S (every one held:
Kubernetes then takes the replica out of rotation instead of sending it
clients it cannot answer).
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from grain_elevator.server.process.options import HEALTH_THREADS
from grain_elevator.server.serving.grpc_service import first_request

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A Describe is a few microseconds of work: a thread pool that cannot start
# one within this long is held by something else. Several arrival deadlines
# (grpc_service.REQUEST_ARRIVAL_TIMEOUT_S), so a burst of header-only calls,
# which the deadline clears in about one, does not flap the status.
PROBE_TIMEOUT_S = 5.0
PROBE_PERIOD_S = 0.5


class Health:
  """The worker's health status, and the gRPC service that reports it."""

  def __init__(self, services: tuple[str, ...]):
    self.servicer = health.HealthServicer()
    self._services = services
    self._lock = threading.Lock()
    self._reasons: set[str] = set()
    self._stop = threading.Event()

  def add_to_server(self, server: grpc.Server) -> None:
    check_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health")
    watch_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, "elevator-health-watch")

    def first(method: Any, request: Any, pool: futures.ThreadPoolExecutor,
              nothing: Any) -> Any:
      """`method` on the call's `request`; `nothing()` (never sent: the call
      is over) when it did not come."""
      def call(requests: Any, context: grpc.ServicerContext) -> Any:
        message = first_request(requests, context, request)
        return nothing() if message is None else method(message, context)
      call.experimental_thread_pool = pool  # type: ignore[attr-defined]
      return call

    pb = health_pb2
    handlers = {
        "Check": grpc.stream_unary_rpc_method_handler(
            first(self.servicer.Check, pb.HealthCheckRequest, check_pool,
                  pb.HealthCheckResponse),
            response_serializer=pb.HealthCheckResponse.SerializeToString),
        "List": grpc.stream_unary_rpc_method_handler(
            first(self.servicer.List, pb.HealthListRequest, check_pool,
                  pb.HealthListResponse),
            response_serializer=pb.HealthListResponse.SerializeToString),
        "Watch": grpc.stream_stream_rpc_method_handler(
            first(self.servicer.Watch, pb.HealthCheckRequest, watch_pool, lambda: iter(())),
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(health.SERVICE_NAME, handlers),))

  def publish(self) -> None:
    """Sets every service's status from the reasons now on."""
    with self._lock:
      status = NOT_SERVING if self._reasons else SERVING
    for service in self._services:
      self.servicer.set(service, status)

  def set_reason(self, reason: str, on: bool) -> None:
    """NOT_SERVING while any reason is on ("crash loop", "threads")."""
    with self._lock:
      before = bool(self._reasons)
      (self._reasons.add if on else self._reasons.discard)(reason)
      changed = before != bool(self._reasons)
    if changed:
      self.publish()

  def watch_pool(self, pool: futures.ThreadPoolExecutor) -> None:
    """From a daemon thread: NOT_SERVING while `pool` cannot start a task
    within PROBE_TIMEOUT_S."""
    def probe() -> None:
      while not self._stop.wait(PROBE_PERIOD_S):
        started = threading.Event()
        try:
          pool.submit(started.set)
        except RuntimeError:  # shut down
          return
        if started.wait(PROBE_TIMEOUT_S):
          continue
        self.set_reason("threads", True)
        while not started.wait(PROBE_PERIOD_S):  # until a thread takes it
          if self._stop.is_set():
            return
        self.set_reason("threads", False)
    threading.Thread(target=probe, name="elevator-health-probe", daemon=True).start()

  def stop(self) -> None:
    """NOT_SERVING for good (graceful shutdown)."""
    self._stop.set()
    self.servicer.enter_graceful_shutdown()
