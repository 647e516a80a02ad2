"""Probes as a kubelet makes them: N health Checks, one after another, each on
a fresh connection; prints each one's seconds as a JSON list (null: it did
not answer SERVING). A process of its own, so that what the test process
does meanwhile (its attackers) cannot delay the probes it times; the first
Check, which pays for this process's gRPC start-up (a kubelet's runs for
good), is not counted. Run by tests/server/serving/test_health_port.py.
"""

from __future__ import annotations

import argparse
import json
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _check(target: str) -> float | None:
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    start = time.monotonic()
    try:
      reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=5)
    except grpc.RpcError:
      return None
    took = time.monotonic() - start
  return took if reply.status == health_pb2.HealthCheckResponse.SERVING else None


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--probes", type=int, required=True)
  args = p.parse_args()
  _check(args.target)  # warm-up
  print(json.dumps([_check(args.target) for _ in range(args.probes)]))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
