"""The whole server's health, as the health port reports it.

Each worker writes its own state into shared memory (a slot per worker):
a heartbeat, beaten twice a second by its health probe thread
(server/serving/health.py), and whether its request threads are all held.
The supervisor adds what only it knows (starting, stopping, a crash loop)
and reads the slots when a probe asks: answering costs no worker anything
and waits for none of them, whatever holds their ports.

The server is SERVING when none of these is on (`reasons()` names them):
  * it is starting or stopping;
  * a slot is crash-looping (server/process/restarts.py);
  * a live worker's request threads cannot start a task
    (PROBE_TIMEOUT_S, server/serving/health.py);
  * a live worker has not beaten for PROBE_TIMEOUT_S: it is hung or stopped
    (SIGSTOP), which no port of its own would say;
  * no worker is serving at all (every one dead or restarting, as when the
    fork server dies): a slot without a worker says nothing of its own.
One worker's trouble makes the whole server NOT_SERVING, as a crash loop
does (server/process/supervisor.py says why: a probe cannot pick its worker).

Shared memory without a lock: each slot has one writer, its worker, whose
death must not leave a lock held; a double and an int need none.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from grain_elevator.server.serving.health import PROBE_TIMEOUT_S

_NEVER = 0.0  # the heartbeat of a slot whose worker has not started serving


class HealthBoard:
  """Per-worker health slots (written by workers) and the server's own
  reasons (the supervisor's). Passed to each worker, which uses its slot."""

  def __init__(self, ctx: Any, num_workers: int):
    self._beats = ctx.RawArray("d", num_workers)  # time.monotonic() of the last beat
    self._held = ctx.RawArray("i", num_workers)  # 1 while every request thread is held
    self._lock = threading.Lock()  # the supervisor's side only
    self._own: set[str] = set()

  def slot(self, index: int) -> "WorkerSlot":
    """Worker `index`'s side (health.WorkerReport)."""
    return WorkerSlot(self, index)

  # -- the supervisor's side -------------------------------------------------

  def reset(self, index: int) -> None:
    """Slot `index` has no serving worker (dead, or not started yet)."""
    self._beats[index] = _NEVER
    self._held[index] = 0

  def set_reason(self, reason: str, on: bool) -> None:
    """The supervisor's own reasons: "starting", "stopping", "crash loop"."""
    with self._lock:
      (self._own.add if on else self._own.discard)(reason)

  def reasons(self, now: float | None = None) -> list[str]:
    """Why the server is not SERVING; [] when it is."""
    now = time.monotonic() if now is None else now
    with self._lock:
      out = sorted(self._own)
    beats = self._beats[:]
    if all(beat == _NEVER for beat in beats) and not out:
      out.append("no worker is serving")
    for i, beat in enumerate(beats):
      if beat == _NEVER:
        continue
      if now - beat > PROBE_TIMEOUT_S:
        out.append(f"worker {i} has not answered for {now - beat:.0f}s")
      elif self._held[i]:
        out.append(f"worker {i} has no free request thread")
    return out


class WorkerSlot:
  """What worker `index` writes: its heartbeat and whether its request
  threads are all held (server/serving/health.py's probe thread)."""

  def __init__(self, board: HealthBoard, index: int):
    self._beats = board._beats  # pylint: disable=protected-access
    self._held = board._held  # pylint: disable=protected-access
    self._index = index

  def beat(self) -> None:
    self._beats[self._index] = time.monotonic()  # one clock for every process of the machine

  def set_held(self, held: bool) -> None:
    self._held[self._index] = int(held)
