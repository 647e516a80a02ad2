"""Fixtures of the serving tests."""

from __future__ import annotations

from typing import Iterator

import pytest
from grpc_health.v1 import health_pb2

from grain_elevator.server.serving import health_port as hp


@pytest.fixture
def lone_health_port() -> Iterator[tuple[str, int]]:
  """(host, port) of a health port alone in this process, always SERVING:
  its loop is the supervisor's thread without the rest of a server."""
  health = hp.HealthPort(lambda: health_pb2.HealthCheckResponse.SERVING, ("",), watch_s=5.0)
  try:
    yield "127.0.0.1", health.start("127.0.0.1", 0)
  finally:
    health.stop()
