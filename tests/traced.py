"""Allocations counted in a fresh interpreter, never in the test process.

tracemalloc counts allocations exactly, the same on every run however loaded
the machine, which makes it the right meter for a memory bound. But tracing
in the pytest process races native threads that attach to Python while it
is on: CPython 3.11 can crash in tracemalloc's traceback_new as such a
thread (obstore's, gRPC's, left by earlier tests) allocates its thread state
(server/data/streams/object_bytes.py tells the story). A spawned child has
no such threads: it imports only what `fn` needs.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import tracemalloc
from typing import Any, Callable

TIMEOUT_S = 300


def _run(fn: Callable[..., Any], args: tuple) -> tuple[Any, int, int]:
  tracemalloc.start()
  try:
    result = fn(*args)
  finally:
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
  return result, held, peak


def traced(fn: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
  """`fn(*args)` run in a spawned interpreter under tracemalloc: its result
  (which must pickle), the bytes still allocated when it returned (what the
  result keeps alive included) and the peak. `fn` must be a module-level
  function: the child imports it by name."""
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as child:
    return child.submit(_run, fn, args).result(timeout=TIMEOUT_S)
