"""Receiving a bulk step straight into its leaves' arrays.

The element spec fixes every byte of a step's uncompressed Batch but the
tensor data and the step's number, which the receiver knows too
(proto/wire.py `BatchLayout`). So a step is read with one scatter read
(`recvmsg_into`, MSG_WAITALL) into one buffer from the pool: each leaf's
data lands at an offset of its own, aligned (`Placement`), and the bytes
between leaves land in a small scratch buffer, compared in one go with what
they must be. Nothing is parsed in Python and no byte is copied twice; the
comparison checks each leaf's dtype and shape, and the step, as parsing
would. The kernel's copy from the socket is then most of what a step costs.

A payload that is not that exact encoding (compressed, a peer's lie, another
encoder's field order) is put back together in order and goes to
`decode_step`, which reads any valid Batch and names the fault of any other:
only its cost differs.
"""

from __future__ import annotations

import functools
import socket
from typing import Callable

import numpy as np

from grain_elevator.client.transport.buffers import PAGE
from grain_elevator.proto import framing
from grain_elevator.proto import wire

# Every leaf starts on a cache line (what XLA asks of host memory it reads in
# place); leaves this large start on a page, where the kernel's copy is fastest.
ALIGN = 64
PAGE_ALIGN_BYTES = 64 << 10
# Pieces in one scatter read: a leaf and the bytes before it are two, and
# Linux takes up to 1024 (IOV_MAX) at once. More leaves: decode_step.
MAX_PIECES = 1000


class Placement:
  """Where each leaf of a step goes in its receive buffer, and the buffer's
  size: `runs` is (bytes before the leaf's data, its offset, its size) per leaf."""

  def __init__(self, layout: wire.BatchLayout):
    runs, pos = [], 0
    for head, size in zip(layout.heads, layout.sizes):
      align = PAGE if size >= PAGE_ALIGN_BYTES else ALIGN
      pos = -(-pos // align) * align
      runs.append((len(head), pos, size))
      pos += size
    self.runs = tuple(runs)
    self.nbytes = max(pos, 1)
    self.scatters = 2 * len(runs) + 1 <= MAX_PIECES


@functools.lru_cache(maxsize=64)
def placement_of(layout: wire.BatchLayout) -> Placement:
  return Placement(layout)


def receive_step(sock: socket.socket, size: int, step: int, layout: wire.BatchLayout,
                 take: Callable[[int], np.ndarray]
                 ) -> tuple[list[np.ndarray], str, int] | np.ndarray:
  """The `size`-byte payload of step `step`'s frame (its header read and
  checked; `size` at least `layout.size(step)`, the rest a stream position
  and a production time): its (leaves, next_stream_state, production_us),
  or the payload in one piece, from `take`, when it is not the layout's
  exact encoding."""
  prefix = wire.step_field(step)
  place = placement_of(layout)
  buf = take(place.nbytes)
  fixed = len(prefix) + len(layout.joined_heads)
  scratch = memoryview(bytearray(fixed + size - layout.size(step)))  # gaps, then the tail
  data = memoryview(buf)
  pieces, at, first = [], 0, len(prefix)
  for head, offset, n in place.runs:
    end = at + first + head
    pieces += (scratch[at:end], data[offset:offset + n])
    at, first = end, 0
  pieces.append(scratch[at:])
  framing.recv_into_all(sock, pieces)
  if scratch[:fixed] == prefix + layout.joined_heads:
    tail = wire.canonical_tail(scratch[fixed:])
    if tail is not None:
      return [np.ndarray(leaf.shape, leaf.dtype, buffer=buf, offset=offset)
              for leaf, (_, offset, _) in zip(layout.leaves, place.runs)], *tail
  whole = take(size)  # not the encoder's bytes: in order again, for the parser
  at = 0
  for piece in pieces:
    whole[at:at + len(piece)] = piece
    at += len(piece)
  return whole
