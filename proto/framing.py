"""Framing of the bulk transport (see the end of elevator.proto).

Both ends send MAGIC, then frames: a 1-byte kind, an 8-byte little-endian
payload length, the payload. A frame header is checked against the
receiver's expectations (its kinds, its size limit) before anything is
allocated for the payload, by `check_header`, for both ends. The receiver
chooses where a payload lands (`recv_payload`'s `alloc`, or a scatter read,
`recv_into_all`): the bulk client lends buffers that are reused only once
nothing refers to the arrays received into them
(client/transport/buffers.py).
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Callable, Sequence

import numpy as np

MAGIC = b"GEB1"
HELLO, REQUEST, BATCH, STATUS = 1, 2, 3, 4
KINDS = {HELLO: "hello", REQUEST: "request", BATCH: "batch", STATUS: "status"}
_HEADER = struct.Struct("<BQ")
HEADER_SIZE = _HEADER.size
_IOV_MAX = 512


class ProtocolError(ConnectionError):
  """The peer does not speak the bulk protocol (or broke it)."""


class UnexpectedKind(ProtocolError):
  """A frame of a kind the receiver does not expect now."""


class FrameTooLarge(ProtocolError):
  """A frame longer than the receiver's limit (refused from its header)."""


def send_parts(sock: socket.socket, parts: Sequence[Any]) -> None:
  """Sends every buffer in order with as few syscalls as the kernel allows,
  without joining them (tensor data is not copied). Each part is a flat byte
  buffer (bytes, or a memoryview cast to "B"), so len() is its size."""
  views = [p for p in parts if len(p)]
  while views:
    try:
      sent = sock.sendmsg(views[:_IOV_MAX])
    except BlockingIOError as e:  # a blocking socket's SO_SNDTIMEO passed
      raise TimeoutError("the peer took nothing within the socket's timeout") from e
    while sent:
      if sent >= len(views[0]):
        sent -= len(views[0])
        views.pop(0)
      else:  # a partial send, rare on a blocking socket: resend the rest
        views[0] = memoryview(views[0]).cast("B")[sent:]
        sent = 0


def header(kind: int, size: int) -> bytes:
  return _HEADER.pack(kind, size)


def parse_header(data: bytes | bytearray) -> tuple[int, int]:
  """(kind, payload length) of a frame header, unchecked (see check_header)."""
  return _HEADER.unpack(data)


def check_header(data: bytes | bytearray, expect: Sequence[int], limit: int
                 ) -> tuple[int, int]:
  """(kind, payload length) of a frame header whose kind is in `expect` and
  length at most `limit`; else UnexpectedKind or FrameTooLarge, before
  anything is allocated for the payload."""
  kind, size = parse_header(data)
  if kind not in expect:
    raise UnexpectedKind(f"expected a {'/'.join(KINDS.get(k, str(k)) for k in expect)} "
                         f"frame, got kind {kind}")
  if size > limit:
    raise FrameTooLarge(f"{KINDS[kind]} frame of {size} bytes is over this end's "
                        f"limit of {limit}")
  return kind, size


def frame(kind: int, payload: bytes) -> bytes:
  """A small frame as one buffer."""
  return header(kind, len(payload)) + payload


def send_frame(sock: socket.socket, kind: int, parts: Sequence[Any]) -> int:
  """One frame; `parts` as for send_parts. Returns the payload's bytes."""
  size = sum(len(p) for p in parts)
  send_parts(sock, [header(kind, size), *parts])
  return size


def recv_into(sock: socket.socket, view: memoryview) -> None:
  """Fills `view` from `sock`. MSG_WAITALL lets a blocking socket fill it
  in one call, however the bytes trickle in; on a socket with a Python
  timeout (non-blocking underneath) it is a plain read and the loop goes on."""
  recv_into_all(sock, [view])


def recv_into_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
  """Fills each of `views` in turn from `sock` with as few calls as the
  kernel allows (a scatter read: `recvmsg_into`, at most _IOV_MAX at once).
  A blocking socket whose SO_RCVTIMEO passes with nothing read is a
  TimeoutError, as a Python timeout would be."""
  total, got, left = sum(map(len, views)), 0, views
  while got < total:
    try:
      r = sock.recvmsg_into(left[:_IOV_MAX] if len(left) > _IOV_MAX else left, 0,
                            socket.MSG_WAITALL)[0]
    except BlockingIOError as e:
      raise TimeoutError(f"no data within the socket's timeout, after {got} of {total} "
                         "bytes") from e
    if not r:
      raise ConnectionResetError(f"connection closed after {got} of {total} bytes")
    got += r
    if got < total:  # cut short (a timeout, a signal, a socket with a Python timeout)
      left = list(left) if left is views else left
      while r:
        if r >= len(left[0]):
          r -= len(left.pop(0))
        else:
          left[0] = left[0][r:]
          r = 0


def recv_header(sock: socket.socket, expect: Sequence[int], limit: int) -> tuple[int, int]:
  """The next frame's (kind, payload length), checked (`check_header`)
  before anything is allocated for its payload."""
  header = bytearray(_HEADER.size)
  recv_into(sock, memoryview(header))
  return check_header(header, expect, limit)


def recv_payload(sock: socket.socket, size: int,
                 alloc: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
  """A payload of `size` bytes (its header checked) in a uint8 array from
  `alloc(size)` (default: a new one, uninitialised before the read, so no
  memset is paid)."""
  payload = alloc(size) if alloc is not None else np.empty(size, dtype=np.uint8)
  if size:
    recv_into(sock, memoryview(payload))
  return payload


def recv_frame(sock: socket.socket, expect: Sequence[int], limit: int,
               alloc: Callable[[int], np.ndarray] | None = None) -> tuple[int, np.ndarray]:
  """The next frame's (kind, payload) (`recv_header`, then `recv_payload`).
  A frame of another kind, or longer than `limit` bytes, is a ProtocolError
  raised before its payload is read or allocated."""
  kind, size = recv_header(sock, expect, limit)
  return kind, recv_payload(sock, size, alloc)


def exchange_magic(sock: socket.socket) -> None:
  sock.sendall(MAGIC)
  got = bytearray(len(MAGIC))
  recv_into(sock, memoryview(got))
  if bytes(got) != MAGIC:
    raise ProtocolError(f"peer sent {bytes(got)!r}, not the bulk protocol's {MAGIC!r}")
