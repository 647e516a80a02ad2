"""The bulk transport's client: one request at a time over a plain socket.

Each step is read with one scatter read straight into its leaves' arrays
and the bytes between them checked whole against what the element spec
makes them (client/transport/receive.py): one copy from the kernel, nothing
parsed, no protobuf objects, no gRPC buffers. A step in any other encoding
(compressed, or not the spec's) is read into one buffer and parsed
(client/transport/connection.py `decode_step`). Buffers come from a pool
and are reused once the trainer has dropped the batch
(client/transport/buffers.py), so their pages are not faulted in afresh;
when batches go to a GPU they are page-locked (host_memory.py). A frame
longer than the step the request can produce is refused before anything is
allocated (proto/framing.py).

The socket blocks, with the kernel's SO_RCVTIMEO as the timeout: a Python
timeout would poll before every read, and MSG_WAITALL lets one read take a
whole step however its bytes trickle in, waking the thread once. Failures surface as
a `TransportError` with the status code gRPC would have given, so the pool
treats both transports alike; a server breaking the protocol mid-request is
a `BadReplyError`, as on gRPC.
"""

from __future__ import annotations

import socket
import struct
from typing import Sequence

import grpc
from google.protobuf.message import DecodeError

from grain_elevator.client.transport.buffers import BufferPool
from grain_elevator.client.transport.connection import (BadReplyError, CancelToken, Steps,
                                                        TransportError, check_position,
                                                        decode_step)
from grain_elevator.client.transport.receive import placement_of, receive_step
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import framing
from grain_elevator.proto import wire
from grain_elevator.proto.spec import LeafSpec

# ServerInfo and BulkStatus frames are a few dozen bytes.
_MAX_SMALL_FRAME_BYTES = 1 << 20


def _set_timeout(sock: socket.socket, timeout_s: float) -> None:
  """Blocking reads and writes that fail after `timeout_s` without progress."""
  sock.setblocking(True)
  micros = max(1, int(min(timeout_s, 1e9) * 1e6))  # a zero timeval would never time out
  t = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, t)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, t)


class BulkConnection:
  """One TCP connection to one worker's bulk port."""

  capacity = 1

  def __init__(self, target: str, host: str, port: int, *, connect_timeout_s: float,
               auth_token: str | None = None, buffers: BufferPool | None = None):
    self.target, self.host = target, host
    self._auth_token = auth_token or ""
    self.address = f"{host}:{port}"
    try:
      self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
      raise TransportError(grpc.StatusCode.UNAVAILABLE,
                           f"bulk transport {self.address}: {e}") from e
    self.broken = False
    self._timeout_s: float | None = None  # set on the socket by the first request
    self._buffers = buffers or BufferPool()
    # The leaves of the last request and their layout (None: no scatter read)
    self._expect: Sequence[LeafSpec] | None = None
    self._exact: wire.BatchLayout | None = None
    try:
      self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      framing.exchange_magic(self._sock)
      _, payload = framing.recv_frame(self._sock, (framing.HELLO,), _MAX_SMALL_FRAME_BYTES)
      self.server = pb.ServerInfo.FromString(payload.tobytes())
    except (OSError, framing.ProtocolError, DecodeError) as e:
      self.close()
      raise TransportError(grpc.StatusCode.UNAVAILABLE,
                           f"bulk transport {self.address}: handshake failed: {e}") from e

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int, expect: Sequence[LeafSpec] | None = None,
             positions_of: str | None = None) -> Steps:
    """See `Connection.stream`. `timeout_s` bounds each wait for data, so a
    frozen server cannot hang the trainer."""
    where = f"{self.address} (bulk transport)"
    token.attach(self)
    try:
      if timeout_s != self._timeout_s:
        _set_timeout(self._sock, timeout_s)
        self._timeout_s = timeout_s
      message = pb.BulkRequest(request=request, auth_token=self._auth_token)
      framing.send_frame(self._sock, framing.REQUEST, [message.SerializeToString()])
      exact = None  # the layout of the encoder's bytes, where a scatter read can take them
      if expect is not None and request.compression == wire.COMPRESSION_NONE:
        if expect is not self._expect:  # the pool passes one tuple per dataset and rows
          layout = wire.layout_of(tuple(expect))
          self._expect, self._exact = expect, layout if placement_of(layout).scatters else None
        exact = self._exact
      for index in range(request.num_steps):
        step = request.start_step + index
        try:
          kind, size = framing.recv_header(self._sock, (framing.BATCH, framing.STATUS),
                                           max(max_frame_bytes, _MAX_SMALL_FRAME_BYTES))
        except framing.ProtocolError as e:  # a frame of another kind, or over the limit
          raise BadReplyError(f"{where} broke the protocol for dataset {request.dataset!r} "
                              f"step {step}: {e}") from e
        if kind == framing.STATUS:
          status = pb.BulkStatus.FromString(framing.recv_payload(self._sock, size).tobytes())
          raise TransportError(errors.code_from_number(status.code), status.message,
                               status.error_type)
        if exact and exact.size(step) <= size <= max_frame_bytes:
          got = receive_step(self._sock, size, step, exact, self._buffers.take)
          if isinstance(got, tuple):  # the encoder's bytes, checked whole
            check_position(got[1], request, step, where, positions_of)
            yield step, *got
            continue
          payload = got
        else:
          payload = framing.recv_payload(self._sock, size, self._buffers.take)
        yield decode_step(payload, request, index, max_frame_bytes, expect, where,
                          positions_of=positions_of)
    except BadReplyError:
      self.broken = True  # unread frames may remain
      raise
    except socket.timeout as e:
      self.broken = True
      raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"bulk transport {self.address}: no data for {timeout_s:.0f}s") from e
    except (OSError, DecodeError) as e:
      self.broken = True
      raise TransportError(grpc.StatusCode.UNAVAILABLE,
                           f"bulk transport {self.address}: {e}") from e
    except GeneratorExit:
      self.broken = True  # abandoned mid-request: unread frames remain
      raise
    finally:
      token.attach(None)

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
