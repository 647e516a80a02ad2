"""A large job's connections on one worker, on 127.0.0.1: idle and active
bulk and gRPC connections, header-only gRPC calls, and a default client
that must still read the exact stream, while health answers and the
worker's descriptors and memory stay within their stated bounds.

`make test` runs it at a bounded size; the full size (2,000+ connections)
runs by hand:  ELEVATOR_LOAD_CONNECTIONS=2200 .venv/bin/pytest -s tests/server/serving/test_load.py
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.proto import framing
from grain_elevator.server.process import descriptors
from grain_elevator.server.process.options import ServerOptions
from grain_elevator.server.serving.grpc_service import REQUEST_ARRIVAL_TIMEOUT_S, SERVICE_NAME
from grain_elevator.tools.bench.h2peer import H2Peer
from grain_elevator.tools.launcher import LocalServer
from helpers import assert_streams_equal, worker_pids

CONNECTIONS = int(os.environ.get("ELEVATOR_LOAD_CONNECTIONS", "600"))
HEADER_ONLY_CALLS = 200
# What a worker may grow by above its resting size: each idle connection's
# kernel socket and gRPC's per-connection state (measured ~20-40 KB), each
# header-only call's stream, plus the client's batches in flight.
RSS_PER_CONNECTION = 64 << 10
RSS_SLACK = 256 << 20


def _bulk_idle(server) -> socket.socket:
  s = socket.create_connection((server.host, server.bulk_port), timeout=10)
  s.sendall(framing.MAGIC)
  return s


@pytest.mark.slow
def test_a_large_job_on_one_worker(config_path):
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  need = 2 * CONNECTIONS + 512
  if hard != resource.RLIM_INFINITY and hard < need:
    pytest.skip(f"the open-files limit ({hard}) is below the {need} this test needs")
  resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
  opts = ServerOptions()
  grpc_idle = min(CONNECTIONS // 2, opts.max_grpc_connections - 64)
  bulk_idle = CONNECTIONS - grpc_idle
  # 127.0.0.1 stands for the job's many hosts: no limit per address.
  with LocalServer(config_path, workers=1, extra_args=(
      "--max-bulk-connections-per-peer", str(opts.max_bulk_connections))) as server:
    (worker,) = worker_pids(server)
    proc = psutil.Process(worker)
    time.sleep(1.0)
    rest_rss = proc.memory_info().rss
    held: list = []
    peers: list[H2Peer] = []
    try:
      held += [_bulk_idle(server) for _ in range(bulk_idle)]
      peers += [H2Peer(server.host, server.port) for _ in range(grpc_idle)]
      for p in peers[:HEADER_ONLY_CALLS // 10]:
        for _ in range(10):
          p.open_call(f"/{SERVICE_NAME}/Describe")
      health_s: list[float] = []
      stop = threading.Event()

      def probe() -> None:
        with grpc.insecure_channel(server.target) as channel:
          stub = health_pb2_grpc.HealthStub(channel)
          while not stop.is_set():
            start = time.monotonic()
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            health_s.append(time.monotonic() - start)
            time.sleep(0.2)
      prober = threading.Thread(target=probe)
      prober.start()
      try:
        for kind in ("auto", "grpc"):  # the default client, and over gRPC
          with RemoteDataset(server.target, "plain", 64,
                             transport=TransportOptions(kind=kind)) as ds, \
               RemoteDataset.embedded(config_path, "plain", 64) as local:
            assert assert_streams_equal(ds, local) == 15
        fds = proc.num_fds()
        rss = proc.memory_info().rss
        time.sleep(2 * REQUEST_ARRIVAL_TIMEOUT_S)  # probes past the calls' deadline
      finally:
        stop.set()
        prober.join()
    finally:
      for s in held:
        s.close()
      for p in peers:
        p.close()
  budget = descriptors.Budget(opts.max_bulk_connections, opts.max_grpc_connections, 4)
  print(f"\n{bulk_idle} idle bulk + {grpc_idle} idle gRPC connections, "
        f"{HEADER_ONLY_CALLS} header-only calls: worker fds {fds} (budget {budget.total}), "
        f"RSS {rss >> 20} MiB (at rest {rest_rss >> 20} MiB), health max "
        f"{max(health_s) * 1000:.0f} ms over {len(health_s)} probes")
  assert fds <= budget.total
  assert rss - rest_rss <= CONNECTIONS * RSS_PER_CONNECTION + RSS_SLACK
  assert health_s and max(health_s) < 5.0  # a generous bound; the figure is printed
