"""Keep big buffers in the trainer process instead of returning them to the OS.

glibc serves allocations above 128 KiB (adaptive up to 32 MiB) with mmap and
unmaps them on free, so every received multi-megabyte batch is page-faulted
in afresh. The settings DESIGN.md §3 measured (mmap threshold 32 MiB, trim
threshold 1 GiB) cut the client's CPU per GB received by about 2x here
(BENCHMARKS.md). `elevator serve` sets them for its workers by environment;
a trainer can call `tune_malloc()` once at start-up, since the environment
variables only work before the process starts.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
  """Applies the settings with glibc's mallopt; False where unavailable."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
      libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
