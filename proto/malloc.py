"""glibc settings for processes that move multi-megabyte batches.

glibc serves allocations above 128 KiB (adaptive up to 32 MiB) with mmap and
unmaps them on free, so every batch buffer is page-faulted in afresh. An mmap
threshold of 32 MiB and a trim threshold of 1 GiB keep those buffers in the
process: they nearly double gRPC throughput, cut the cost of encoding a 3 MB
batch from ~8 ms to ~0.6 ms (BENCHMARKS.md, "Moving bytes between processes"). `elevator
serve` gives them to its workers by environment (`ENV`). The client needs
none: it receives into page-aligned buffers it reuses (client/transport/buffers.py),
and `tune_malloc()` in a trainer measured within noise of without
(BENCHMARKS.md, "A default client against the tuned one"); benchmarks call
it to show that.
"""

from __future__ import annotations

import ctypes
import sys

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
# The same settings for a process about to start.
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
       "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD,
                trim_threshold: int = TRIM_THRESHOLD) -> bool:
  """Applies the settings to this process with glibc's mallopt; False where
  unavailable (not Linux, not glibc)."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
      libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
