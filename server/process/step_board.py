"""Steps whose making killed a worker, remembered for the whole server.

A record that crashes its pipeline in native code (a segfault in a decoder)
kills the worker making it, and a client retrying the step would kill the
next one, and the next: every worker of the server, at every retry. So each
worker notes, in shared memory, the steps its request threads are making
(`WorkerSteps.begin`, from server/serving/step_errors.py), and the
supervisor, when a worker dies, finds which of them killed it
(supervisor.py's `_blame`) and posts it on the board's list of failed
steps. Every worker refuses a failed step from then on with DATA_LOSS naming
the dataset and step (a status the client does not retry), instead of
making it again.

A step is identified by what the request path says of it (step_errors.py):
the dataset, the step (and a stream's position) and the request's geometry
(its key: step_errors.key_of), so another job reading the same step at
another batch size is not refused.

Shared memory without a lock: an in-flight entry has one writer, its
worker's thread (its text written before its key, its key cleared first),
read by the supervisor only once that worker is dead; a failed entry has one
writer, the supervisor, and readers check its key at both ends around the
text and a version number bumped after each write.
"""

from __future__ import annotations

import threading
from typing import Any

# Bytes of an entry's text (the step and the death it caused), cut short.
ENTRY_BYTES = 512
# Steps a worker can note as in flight at once; a step beyond is made untracked.
IN_FLIGHT_PER_WORKER = 64
# Failed steps the server remembers; past it the oldest is forgotten (and
# costs a worker again if asked for).
MAX_FAILED_STEPS = 256


def _cut(text: str) -> bytes:
  data = text.encode()[:ENTRY_BYTES]
  return data.decode(errors="ignore").encode()  # no half a character at the end


class StepBoard:
  """The in-flight steps of every worker slot, and the failed steps."""

  def __init__(self, ctx: Any, num_workers: int, in_flight: int = IN_FLIGHT_PER_WORKER):
    self.in_flight = in_flight
    n = num_workers * in_flight
    self._flight_keys = ctx.RawArray("Q", n)      # 0: free
    self._flight_threads = ctx.RawArray("Q", n)   # threading.get_ident() of its maker
    self._flight_text = ctx.RawArray("c", n * ENTRY_BYTES)
    self._failed_keys = ctx.RawArray("Q", MAX_FAILED_STEPS)
    self._failed_check = ctx.RawArray("Q", MAX_FAILED_STEPS)  # the key again, after the text
    self._failed_text = ctx.RawArray("c", MAX_FAILED_STEPS * ENTRY_BYTES)
    self._version = ctx.RawValue("Q", 0)  # bumped after each failed entry written
    self._posted = 0  # failed entries written (the supervisor's side only)

  def slot(self, index: int) -> "WorkerSteps":
    """Worker `index`'s side."""
    return WorkerSteps(self, index)

  # -- the supervisor's side -------------------------------------------------

  def taken(self, index: int) -> list[tuple[int, int, str]]:
    """(key, thread ident, text) of each step worker `index` was making
    when it died; read only once it is dead."""
    out = []
    for e in range(index * self.in_flight, (index + 1) * self.in_flight):
      key = self._flight_keys[e]
      if key:
        text = self._flight_text[e * ENTRY_BYTES:(e + 1) * ENTRY_BYTES]
        out.append((key, self._flight_threads[e], text.rstrip(b"\0").decode(errors="replace")))
    return out

  def clear(self, index: int) -> None:
    """Slot `index` has no worker: nothing in flight."""
    for e in range(index * self.in_flight, (index + 1) * self.in_flight):
      self._flight_keys[e] = 0

  def post(self, key: int, text: str) -> None:
    """Step `key` failed (`text` says which and how): every worker refuses it."""
    if any(self._failed_keys[i] == key for i in range(min(self._posted, MAX_FAILED_STEPS))):
      return
    i = self._posted % MAX_FAILED_STEPS
    self._failed_keys[i] = 0
    self._failed_check[i] = 0
    data = _cut(text).ljust(ENTRY_BYTES, b"\0")
    self._failed_text[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES] = data
    self._failed_check[i] = key
    self._failed_keys[i] = key
    self._posted += 1
    self._version.value += 1


class WorkerSteps:
  """A worker's side: notes the steps its threads make, and knows the failed
  ones. Thread-safe: `_lock` guards the choice of a free entry and the cache
  of failed steps."""

  def __init__(self, board: StepBoard, index: int):
    self._board = board
    self._index = index
    self._lock = threading.Lock()
    first = index * board.in_flight
    self._free = list(range(first + board.in_flight - 1, first - 1, -1))
    self._seen = -1  # the board's version `_failed` was read at
    self._failed: dict[int, str] = {}

  def __reduce__(self) -> Any:  # sent to its worker: made afresh there
    return WorkerSteps, (self._board, self._index)

  def begin(self, key: int, text: str) -> int | None:
    """Notes step `key` as being made by this thread; the entry to `end`,
    or None when every entry is taken (the step is made untracked)."""
    with self._lock:
      if not self._free:
        return None
      e = self._free.pop()
    b = self._board
    b._flight_text[e * ENTRY_BYTES:(e + 1) * ENTRY_BYTES] = _cut(text).ljust(ENTRY_BYTES, b"\0")  # pylint: disable=protected-access
    b._flight_threads[e] = threading.get_ident()  # pylint: disable=protected-access
    b._flight_keys[e] = key  # pylint: disable=protected-access
    return e

  def end(self, entry: int | None) -> None:
    if entry is None:
      return
    self._board._flight_keys[entry] = 0  # pylint: disable=protected-access
    with self._lock:
      self._free.append(entry)

  def failed(self, key: int) -> str | None:
    """What killed a worker making step `key`; None unless it is a failed step."""
    b = self._board
    version = b._version.value  # pylint: disable=protected-access
    if version == 0:
      return None
    with self._lock:
      if version != self._seen:
        self._failed = {}
        for i in range(MAX_FAILED_STEPS):
          k = b._failed_keys[i]  # pylint: disable=protected-access
          if not k:
            continue
          text = b._failed_text[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES]  # pylint: disable=protected-access
          if b._failed_check[i] == k:  # pylint: disable=protected-access
            self._failed[k] = text.rstrip(b"\0").decode(errors="replace")
        self._seen = version
      return self._failed.get(key)
