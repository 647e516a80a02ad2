"""The bytes an object graph holds, found by walking it: how a stream's live
iterator is priced (server/data/streams/stream.py, `iterator_bytes`).

tracemalloc would count the allocations exactly, but tracing in a process
whose native threads attach to Python crashes CPython 3.11: obstore's tokio
threads attach as each read completes (PyGILState_Ensure), allocate their
thread state under the tracer, and die in tracemalloc's traceback_new (a core
of the test process, SIGSEGV on a `tokio-runtime-blocking` thread). Embedded
mode runs in a trainer full of such threads, a worker reading a bucket too.
A walk reads nothing but the objects, with the GIL held.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any, Iterable

# Not descended into: code and definitions every iterator shares.
_SHARED_KINDS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                 types.CodeType)
# Objects visited at most, per walk: a bound on the walk's time (~0.1 s).
MAX_OBJECTS = 200_000


def reachable(roots: Iterable[Any], limit: int = MAX_OBJECTS) -> set[int]:
  """Ids of the objects reachable from `roots` (at most `limit`)."""
  seen: set[int] = set()
  _walk(list(roots), seen, limit)
  return seen


def graph_bytes(roots: Iterable[Any], *, shared: set[int] = frozenset(),  # type: ignore[assignment]
                limit: int = MAX_OBJECTS) -> int:
  """sys.getsizeof summed over the objects reachable from `roots` but not
  from what made `shared` (an array counts its data when it owns it)."""
  return _walk(list(roots), set(shared), limit)


def _walk(stack: list[Any], seen: set[int], limit: int) -> int:
  total = visited = 0
  while stack and visited < limit:
    obj = stack.pop()
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    visited += 1
    if isinstance(obj, _SHARED_KINDS):
      continue
    try:
      total += sys.getsizeof(obj)
    except TypeError:  # an extension type without a size
      pass
    stack.extend(gc.get_referents(obj))
  return total
