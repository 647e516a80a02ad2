"""Receive buffers: page-aligned, and lent out again once the trainer has let
go of a batch.

A bulk frame is read into a buffer and its tensors reach the trainer as
views of that buffer, so the buffer is where the kernel copies the bytes from
the socket: the largest cost of receiving a batch. Two things make that copy
cheap, measured on the 3 MB batches of `elevator bench`'s small workload
(BENCHMARKS.md, "Default client against tuned"):

- A destination aligned to the page. numpy's buffers start 16 bytes into a
  page (malloc's header) and the kernel's copy into them took twice the
  system time of a copy into an aligned one.
- A buffer already faulted in. A fresh multi-megabyte buffer per frame is
  mmapped, page-faulted in on the first write and unmapped when the trainer
  drops the batch (glibc's tunables, `tune_malloc`, hid part of that).

The pool keeps buffers and lends one out again only once nothing else refers
to it: numpy views hold a reference to the array that owns their memory, as
does anything that kept the data without copying it, so reuse can never
overwrite a batch still in use.

Its memory comes from a `HostMemory` (host_memory.py): ordinary memory, or
page-locked memory when batches go to a GPU. Page-locked memory is taken
only for pooled buffers, which are recycled; a frame too small to pool, or
over the pool's bounds, gets ordinary memory, as it does when page-locked
memory runs out.
"""

from __future__ import annotations

import logging
import sys
import threading

import numpy as np

from grain_elevator.client.transport.host_memory import PAGEABLE, AllocationError, HostMemory

log = logging.getLogger("grain_elevator.client")

PAGE = 4096
# Frames of one dataset differ by a few bytes (the step's varint grows), so a
# buffer is made a little larger than asked: it fits the next frame too.
_SLACK = 64 << 10
# Below this a frame is cheap to allocate and copy into; no pooling.
_MIN_POOLED_BYTES = 64 << 10


def _start(buf: np.ndarray) -> int:
  """The offset of `buf`'s first page boundary (computed once per buffer:
  `ctypes.data` costs microseconds, on every step's path)."""
  return -buf.ctypes.data % PAGE


def _aligned(buf: np.ndarray, size: int) -> np.ndarray:
  """`size` bytes of `buf` from its first page boundary."""
  start = _start(buf)
  return buf[start:start + size]


class BufferPool:
  """Up to `max_buffers` receive buffers of `max_bytes` in all from
  `memory`, lent out again when free; frames that do not fit get buffers of
  their own, of ordinary memory."""

  def __init__(self, max_buffers: int = 64, max_bytes: int = 256 << 20,
               memory: HostMemory = PAGEABLE):
    self._max_buffers = max_buffers
    self._max_bytes = max_bytes
    self.memory = memory
    self._buffers: list[np.ndarray] = []  # least recently lent first
    self._starts: list[int] = []  # each buffer's first page boundary (`_start`)
    self._lock = threading.Lock()
    self.unpooled = 0  # frames that got ordinary memory of their own (over the bounds)

  def take(self, size: int) -> np.ndarray:
    """An uninitialised, page-aligned uint8 array of `size` bytes."""
    if size < _MIN_POOLED_BYTES:
      return np.empty(size, dtype=np.uint8)
    need = size + PAGE
    with self._lock:
      # The most recently lent free buffer: the likeliest still in cache.
      bufs = self._buffers
      for i in reversed(range(len(bufs))):
        # free (`_free`, inlined: this runs per step): only the list and
        # getrefcount's argument refer to it
        if sys.getrefcount(bufs[i]) <= 2 and need <= len(bufs[i]) <= 2 * need:
          buf = self._buffers.pop(i)
          start = self._starts.pop(i)
          self._buffers.append(buf)
          self._starts.append(start)
          return buf[start:start + size]
      nbytes = need + _SLACK
      while not self._room_for(nbytes) and self._evict_free():
        pass
      if self._room_for(nbytes):
        try:
          buf = self.memory.allocate(nbytes)
        except AllocationError as e:
          log.warning("receiving into ordinary memory: %s", e)
          self.memory = PAGEABLE
          buf = PAGEABLE.allocate(nbytes)
        self._buffers.append(buf)
        self._starts.append(_start(buf))
        return _aligned(buf, size)
      self.unpooled += 1
    return _aligned(PAGEABLE.allocate(need), size)

  def _free(self, i: int) -> bool:
    """Whether only the pool refers to buffer i: the references are the
    list's and getrefcount's argument; any more is a view still alive."""
    return sys.getrefcount(self._buffers[i]) <= 2

  @property
  def pooled_bytes(self) -> int:
    return sum(len(b) for b in self._buffers)

  def _room_for(self, nbytes: int) -> bool:
    return (len(self._buffers) < self._max_buffers
            and self.pooled_bytes + nbytes <= self._max_bytes)

  def _evict_free(self) -> bool:
    """Drops the least recently lent buffer nothing refers to; False if none."""
    for i in range(len(self._buffers)):
      if self._free(i):
        del self._buffers[i], self._starts[i]
        return True
    return False
