"""Ports that every worker process of one server shares.

Workers bind the same port with SO_REUSEPORT and the kernel spreads new
connections over them. The supervisor binds first (without listening) to
turn port 0 into one fixed free port that nobody else takes while its
workers start; each worker's gRPC server and bulk listener then bind it too.
"""

from __future__ import annotations

import socket

from grain_elevator.proto.errors import ElevatorError


class BindError(ElevatorError):
  """A port cannot be bound (in use without SO_REUSEPORT, or not allowed)."""


def bind_shared(host: str, port: int) -> socket.socket:
  """A TCP socket bound to host:port with SO_REUSEPORT (not yet listening);
  port 0 picks a free one (`getsockname()[1]`)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise BindError(f"cannot bind {host}:{port}: {e.strerror}") from e
  return sock
