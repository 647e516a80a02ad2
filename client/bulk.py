"""The bulk transport's client: one request at a time over a plain socket.

Each batch is read straight into a new buffer with `recv_into` and decoded
as views of it: one copy from the kernel, no protobuf objects, no gRPC
buffers. Failures surface as `BulkRpcError`, a `grpc.RpcError` with the
status code gRPC would have given, so retry and failover treat both
transports alike.
"""

from __future__ import annotations

import socket
from typing import Iterator

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
