"""A large job's connections on one worker, on 127.0.0.1: idle and active
bulk and gRPC connections, header-only gRPC calls, and a default client
that must still read the exact stream, while health answers and the
worker's descriptors and memory stay within their stated bounds.

`make test` runs it at a bounded size; the full size (2,000+ connections)
runs by hand:  ELEVATOR_LOAD_CONNECTIONS=2200 .venv/bin/pytest -s tests/server/serving/test_load.py
"""

from __future__ import annotations

import json
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
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import framing
from grain_elevator.server import Server
from grain_elevator.server.process import descriptors
from grain_elevator.server.serving.options import ServerOptions
from grain_elevator.server.serving.grpc_service import REQUEST_ARRIVAL_TIMEOUT_S, SERVICE_NAME
from grain_elevator.server.serving.stream_sessions import MAX_STREAM_SESSIONS
from grain_elevator.tools import top
from grain_elevator.tools.testing.h2peer import H2Peer
from helpers import assert_streams_equal

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
  # 127.0.0.1 stands for the job's many hosts: no limit per address. In
  # process (~0.4 s to start): only its worker's descriptors and memory count.
  with Server(config_path, ServerOptions(
      port=0, workers=1, max_bulk_connections_per_peer=opts.max_bulk_connections)) as server:
    (worker,) = server.worker_pids()
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


# -- a stream dataset's sessions under load ----------------------------------

STREAM_BUDGET_MB = 16  # --batch-cache-mb: the one worker's sessions get as much again
REFUSED_POSITIONS = 2000
POSITIONS = 400
LONG_STEPS, LONG_G = 150, 256  # one request; its other host never comes


@pytest.mark.slow
def test_stream_sessions_under_load_stay_within_their_bounds(big_config):
  """Refused positions by the thousand, hundreds of valid ones each read by
  one host of sixteen, and a long request whose other host never comes:
  sessions and their bytes stay within the count and the budget, the
  worker's memory with them, and the stream stays exact."""
  budget = STREAM_BUDGET_MB << 20
  with Server(big_config, ServerOptions(port=0, workers=1, metrics_port=0,
                                        batch_cache_mb=STREAM_BUDGET_MB)) as server:
    (worker,) = map(psutil.Process, server.worker_pids())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.ElevatorStub(channel)

    def get(timeout_s: float = 60.0, **request) -> list:
      return list(stub.GetBatches(pb.BatchRequest(dataset="big", **request), timeout=timeout_s))

    with channel:
      (info,) = stub.Describe(pb.DescribeRequest(dataset="big"), timeout=30).datasets
      got = get(global_batch_size=1, shard_count=1, num_steps=POSITIONS)
      positions = [b.next_stream_state for b in got]
      rest = worker.memory_info().rss
      start = json.loads(info.stream_start)
      for i in range(REFUSED_POSITIONS):
        bad = json.dumps({**start, "next_index": 10**19 + i} if i % 2 else {**start, "x": i})
        with pytest.raises(grpc.RpcError) as e:
          get(stream_state=bad, global_batch_size=16, shard_count=1, num_steps=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      for position in positions:  # host 0 of 16 reads one row; the others never come
        assert len(get(stream_state=position, global_batch_size=16, shard_count=16,
                       num_steps=1)) == 1
      long = get(global_batch_size=LONG_G, shard_count=2, num_steps=LONG_STEPS)
      assert len(long) == LONG_STEPS
      grown = worker.memory_info().rss - rest
      m = top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=10)
      sessions = m[("elevator_stream_sessions", ())]
      held = m[("elevator_stream_session_bytes", ())]
      evicted = m[("elevator_stream_session_evictions_total", ())]
    with RemoteDataset(f"127.0.0.1:{server.port}", "big", 16) as remote, \
        RemoteDataset.embedded(big_config, "big", 16) as local:
      r, l = iter(remote), iter(local)
      assert assert_streams_equal([next(r) for _ in range(3)], [next(l) for _ in range(3)]) == 3
  global_batch = 2 * sum(len(t.data) for t in long[0].leaves)  # two hosts' rows
  print(f"\nstream sessions: {sessions:.0f} held ({held / 2**20:.1f} MiB of a "
        f"{STREAM_BUDGET_MB} MiB budget), {evicted:.0f} evicted; worker RSS grew "
        f"{grown / 2**20:.0f} MiB")
  assert sessions <= MAX_STREAM_SESSIONS
  assert held <= budget + global_batch
  assert evicted > 0
  # The budget, one global batch in the making, and the allocator's slack.
  assert grown < budget + global_batch + (48 << 20), f"grew {grown >> 20} MiB"
