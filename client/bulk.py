"""The bulk transport's client: one request at a time over a plain socket.

Each batch is read straight into a new buffer with `recv_into` and decoded
as views of it: one copy from the kernel, no protobuf objects, no gRPC
buffers. Failures surface as `BulkRpcError`, a `grpc.RpcError` with the
status code gRPC would have given, so retry and failover treat both
transports alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
import threading
import time
from typing import Callable, Iterator

import grpc
import numpy as np

from grain_elevator.proto import bulk
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import wire

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class BulkRpcError(grpc.RpcError):
  """A failed bulk request, shaped like a gRPC call's error."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(f"{code.name}: {details}")
    self._code, self._details = code, details

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details


class BulkConnection:
  """One TCP connection to one worker's bulk port."""

  def __init__(self, host: str, port: int, *, connect_timeout_s: float = 5.0):
    self.address = f"{host}:{port}"
    try:
      self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
      raise BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                         f"bulk transport {self.address}: {e}") from e
    self.broken = False
    try:
      self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      bulk.exchange_magic(self._sock)
      _, payload = bulk.recv_frame(self._sock, (bulk.HELLO,))
      self.server = pb.ServerInfo.FromString(payload.tobytes())
    except (OSError, bulk.ProtocolError) as e:
      self.close()
      raise BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                         f"bulk transport {self.address}: handshake failed: {e}") from e

  def stream(self, request: pb.BatchRequest, *, timeout_s: float,
             auth_token: str | None = None) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(step, leaves) for each step of `request`. `timeout_s` bounds each wait
    for data, so a frozen server cannot hang the trainer."""
    try:
      self._sock.settimeout(timeout_s)
      message = pb.BulkRequest(request=request, auth_token=auth_token or "")
      bulk.send_frame(self._sock, bulk.REQUEST, [message.SerializeToString()])
      for _ in range(request.num_steps):
        kind, payload = bulk.recv_frame(self._sock, (bulk.BATCH, bulk.STATUS))
        if kind == bulk.STATUS:
          status = pb.BulkStatus.FromString(payload.tobytes())
          raise BulkRpcError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN),
                             status.message)
        yield wire.decode_batch_bytes(payload)
    except socket.timeout as e:
      self.broken = True
      raise BulkRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"bulk transport {self.address}: no data for {timeout_s:.0f}s") from e
    except (OSError, bulk.ProtocolError, ValueError) as e:
      self.broken = True
      raise BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                         f"bulk transport {self.address}: {e}") from e
    except GeneratorExit:
      self.broken = True  # abandoned mid-request: unread frames remain
      raise

  def cancel(self) -> None:
    """Unblocks a reader in another thread; the connection is then spent."""
    self.broken = True
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass

  def close(self) -> None:
    self.broken = True
    self._sock.close()


@dataclasses.dataclass(eq=False)
class Slot:
  """One bulk connection's place in a pool; reconnected lazily after failing."""
  target: str  # as the user gave it
  host: str  # the replica's address behind it
  conn: BulkConnection
  busy: bool = False
  failures: int = 0
  shunned_until: float = 0.0

  @property
  def replica(self) -> tuple[str, str]:
    return self.target, self.host


class Slots:
  """Bulk connections shared by fetch threads, one request each at a time, so
  they also bound the requests in flight."""

  def __init__(self, slots: list[Slot]):
    self._slots = slots
    self._free = threading.Condition()
    self._next = itertools.count()
    self._closed = False

  def __bool__(self) -> bool:
    return bool(self._slots)

  def __iter__(self) -> Iterator[Slot]:
    return iter(self._slots)

  def checkout(self, cancelled: Callable[[], bool]) -> Slot | None:
    """A free slot (None once cancelled), round-robin, preferring replicas not
    failing lately: waits for a healthy one rather than take a failing one,
    unless all fail."""
    with self._free:
      while True:
        if cancelled() or self._closed:
          return None
        now = time.monotonic()
        healthy = [s for s in self._slots if s.shunned_until <= now]
        free = [s for s in (healthy or self._slots) if not s.busy]
        if free:
          chosen = free[next(self._next) % len(free)]
          chosen.busy = True
          return chosen
        self._free.wait(0.1)

  def release(self, slot: Slot, *, failed: bool) -> None:
    """Frees `slot`. A failure shuns its whole replica for 0.5 s, doubling per
    consecutive failure up to 30 s: its other connections would most likely
    each cost a timeout to find the same."""
    with self._free:
      if failed:
        slot.failures += 1
        until = time.monotonic() + min(30.0, 0.5 * 2**(slot.failures - 1))
        for other in self._slots:
          if other.replica == slot.replica:
            other.shunned_until = max(other.shunned_until, until)
      else:
        slot.failures = 0
      slot.busy = False
      self._free.notify()

  def close(self) -> None:
    with self._free:
      self._closed = True
      for slot in self._slots:
        slot.conn.close()
      self._free.notify_all()
