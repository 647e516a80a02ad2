"""Where received batches live: ordinary memory, or memory page-locked for a GPU.

A copy to a GPU from ordinary (pageable) host memory goes through a staging
buffer of the driver's: a memcpy on the host, then the DMA. From page-locked
memory the DMA reads the batch where it lies, several times faster (on one
H200, issue #35: `jax.device_put` from page-locked numpy 29 GB/s against
6.4 GB/s from ordinary numpy; torch's pinned copy 50 GB/s). So when batches
go to a GPU the bulk transport receives them into page-locked memory: the
receive buffers (buffers.py) come from a `HostMemory`, and are lent again
under the pool's reference-count rule, because page-locking is slow
(cudaHostAlloc takes milliseconds, cudaFreeHost waits for the device).

- `PAGEABLE`: numpy's memory, the default; all there is without CUDA.
- `CudaHostMemory`: cudaHostAlloc through cuda-python (`pip install
  cuda-python`), chosen by `to_device` for a GPU sharding (client/device.py).
- `TorchPinnedMemory`: torch's pinned allocator, chosen by
  `TorchLoader(device="cuda")` (client/torch.py).

Neither optional library is imported until it is asked for. Anything with
`name`, `page_locked` and `allocate` is a HostMemory: a test injects one that
records what it allocates and frees (tests/client/transport/test_host_memory.py).
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Callable, Iterable, Protocol

import numpy as np

log = logging.getLogger("grain_elevator.client")


class AllocationError(RuntimeError):
  """Page-locked memory could not be had (the pool then uses ordinary memory)."""


class HostMemory(Protocol):
  """A source of host memory for receive buffers."""

  name: str
  page_locked: bool  # a GPU can DMA from it directly

  def allocate(self, nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes`, released once it and every
    view of it are gone; AllocationError if none can be had."""


class _Pageable:
  name = "pageable"
  page_locked = False

  def allocate(self, nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


PAGEABLE: HostMemory = _Pageable()


def _cudart() -> Any | None:
  """cuda-python's runtime module (either of its import paths), or None."""
  try:
    from cuda.bindings import runtime  # pylint: disable=g-import-not-at-top
    return runtime
  except ImportError:
    pass
  try:
    from cuda import cudart  # pylint: disable=g-import-not-at-top  # cuda-python < 12.6
    return cudart
  except ImportError:
    return None


class _Block:
  """Owns page-locked memory at `ptr`; numpy arrays over it keep it alive
  (their base), and cudaFreeHost runs once the last of them is gone."""

  def __init__(self, ptr: int, nbytes: int):
    self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                "version": 3}


class CudaHostMemory:
  """cudaHostAlloc (portable: page-locked for every CUDA context, JAX's
  included) through cuda-python's runtime bindings."""

  name = "cudaHostAlloc"
  page_locked = True

  def __init__(self, cudart: Any):
    self._cudart = cudart

  def _check(self, err: Any, what: str) -> None:
    if err != self._cudart.cudaError_t.cudaSuccess:
      raise AllocationError(f"{what} failed: {err}")

  def allocate(self, nbytes: int) -> np.ndarray:
    cudart = self._cudart
    err, ptr = cudart.cudaHostAlloc(max(1, nbytes), cudart.cudaHostAllocPortable)
    self._check(err, f"cudaHostAlloc({nbytes})")
    block = _Block(int(ptr), nbytes)
    # Not at exit: the CUDA runtime may be torn down first; the OS reclaims it.
    weakref.finalize(block, cudart.cudaFreeHost, int(ptr)).atexit = False
    return np.asarray(block)


class TorchPinnedMemory:
  """torch's pinned (page-locked) allocator, as `DataLoader(pin_memory=True)`
  uses; numpy views of its tensors keep them alive."""

  name = "torch pinned"
  page_locked = True

  def allocate(self, nbytes: int) -> np.ndarray:
    import torch  # pylint: disable=g-import-not-at-top
    try:
      return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    except RuntimeError as e:  # out of page-locked memory, or CUDA gone
      raise AllocationError(f"torch pinned allocation of {nbytes} bytes failed: {e}") from e


@functools.cache
def cuda_host_memory() -> CudaHostMemory | None:
  """cudaHostAlloc memory, or None without cuda-python or a CUDA device."""
  cudart = _cudart()
  if cudart is None:
    return None
  err, count = cudart.cudaGetDeviceCount()
  if err != cudart.cudaError_t.cudaSuccess or not count:
    return None
  return CudaHostMemory(cudart)


def torch_pinned_memory() -> TorchPinnedMemory | None:
  """torch's pinned memory, or None where torch has no CUDA device."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return TorchPinnedMemory() if torch.cuda.is_available() else None


@functools.cache
def _say_once(message: str) -> None:
  log.info("%s", message)


def page_locked_for_gpu() -> HostMemory | None:
  """cudaHostAlloc memory; else torch's pinned memory if this process has
  imported torch already (not worth importing it for); else None."""
  memory = cuda_host_memory()
  if memory is None and "torch" in sys.modules:
    memory = torch_pinned_memory()
  return memory


def for_platforms(platforms: Iterable[str], *,
                  cuda: Callable[[], HostMemory | None] = page_locked_for_gpu
                  ) -> HostMemory | None:
  """The page-locked memory to receive batches bound for devices of these
  JAX platforms ("gpu", "cpu", "tpu"): `cuda()` for a GPU, else None
  (ordinary memory: nothing to gain). A GPU without cuda-python is said
  once in the log, with how to get page-locked buffers."""
  if "gpu" not in set(platforms):
    return None
  memory = cuda()
  if memory is None:
    _say_once("batches go to a GPU but are received into ordinary memory: "
              "`pip install cuda-python` for page-locked receive buffers (a faster copy)")
  return memory
