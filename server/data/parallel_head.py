"""A stream's head computed across the server's worker processes.

A stream dataset (stream.py) is one pipeline: its head, `pipeline(records)`
(read, decode, tokenize, filter, flat_map), is random access by index and
costs most of the CPU; what follows it (pack, batch) is sequential and
cheap. Every chunk of a stream is served by one worker (the client routes
them there), so that its Grain iterator goes on where the last chunk ended;
alone, that worker would do all the work on one core. Instead its head
iterator asks for the elements ahead of it in tasks of consecutive indices,
which every worker of the server (itself included) takes from one shared
queue and computes from its own copy of the dataset: the same elements,
whoever computes them, since an element depends on its index alone.

The queues are the supervisor's (multiprocessing, on this host; nothing
crosses the network, so pickling is safe here). A task not answered within
TASK_TIMEOUT_S (its worker died or hangs) is computed by the owner itself.
Queues are read without waiting inside them (`_poll`): a multiprocessing
queue's reader lock is held while a get waits, and a worker SIGKILLed
holding it would leave the queue locked for every other worker for good.
Task ids carry the owner's pid, so answers meant for a worker's earlier
life are never taken for its own.
`ParallelHead` yields exactly what Grain's `to_iter_dataset()` yields, with
the same state ({"next_index": i}), so positions from either continue in
the other.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Callable

import grain

log = logging.getLogger("grain_elevator.server")

# Consecutive head indices per task, and tasks kept in flight per worker.
TASK_ELEMENTS = 32
TASKS_AHEAD_PER_WORKER = 2
# After this long without an answer, the owner computes a task itself.
TASK_TIMEOUT_S = 30.0
# How often an idle queue is looked at: from the first, doubling to the last.
_POLL_S = (0.001, 0.02)


def _poll(q: Any, stop: threading.Event) -> Any:
  """The next item of `q`, or None once `stop` is set; never blocks inside
  the queue (module docstring)."""
  delay = _POLL_S[0]
  while not stop.is_set():
    try:
      return q.get_nowait()
    except queue.Empty:
      time.sleep(delay)
      delay = min(2 * delay, _POLL_S[1])
  return None


class HeadQueues:
  """The server's shared task queue and each worker's result queue: made
  by the supervisor, handed to every worker it spawns (restarts included)."""

  def __init__(self, ctx: Any, num_workers: int):
    self.tasks = ctx.Queue()
    self.results = [ctx.Queue() for _ in range(num_workers)]

  @property
  def num_workers(self) -> int:
    return len(self.results)


class HeadService:
  """One worker's part: computes tasks from the shared queue (a thread),
  and fetches its own streams' elements through it."""

  def __init__(self, queues: HeadQueues, index: int, datasets: Any):
    self._queues = queues
    self._index = index
    self._datasets = datasets
    self._ids = itertools.count()
    self._pending: dict[tuple[int, int], concurrent.futures.Future] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    for target, name in ((self._compute, "elevator-head-compute"),
                         (self._collect, "elevator-head-collect")):
      threading.Thread(target=target, name=name, daemon=True).start()

  def stop(self) -> None:
    self._stop.set()

  def factory(self, dataset: str, fingerprint: str) -> Callable[[grain.MapDataset], Any]:
    """The head factory of one stream dataset (StreamDataset.use_head)."""
    def make(head: grain.MapDataset) -> grain.IterDataset:
      return ParallelHead(head, lambda start, count: self._submit(
          dataset, fingerprint, head, start, count),
          ahead=TASKS_AHEAD_PER_WORKER * self._queues.num_workers)
    return make

  def _submit(self, dataset: str, fingerprint: str, head: grain.MapDataset, start: int,
              count: int) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.local = lambda: _elements(head, start, count)  # type: ignore[attr-defined]
    with self._lock:
      task_id = (os.getpid(), next(self._ids))
      self._pending[task_id] = future
    self._queues.tasks.put((self._index, task_id, dataset, fingerprint, start, count))
    return future

  def _collect(self) -> None:
    """Hands this worker's answers to the futures waiting for them."""
    results = self._queues.results[self._index]
    while not self._stop.is_set():
      try:
        answer = _poll(results, self._stop)
      except (EOFError, OSError):
        return
      if answer is None:
        return
      task_id, elements, error = answer
      with self._lock:
        future = self._pending.pop(task_id, None)
      if future is None or future.done():
        continue  # a task of this worker's earlier life, or computed here already
      if error:
        future.set_exception(RuntimeError(error))
      else:
        future.set_result(elements)

  def _compute(self) -> None:
    """Computes any worker's tasks, this one's included."""
    tasks = self._queues.tasks
    while not self._stop.is_set():
      try:
        task = _poll(tasks, self._stop)
      except (EOFError, OSError):
        return
      if task is None:
        return
      owner, task_id, dataset, fingerprint, start, count = task
      elements, error = None, ""
      try:
        ds = self._datasets.get(dataset)
        if ds.info.config_fingerprint != fingerprint:
          raise RuntimeError(f"dataset {dataset!r} has fingerprint "
                             f"{ds.info.config_fingerprint} here, {fingerprint} asked")
        elements = _elements(ds.head, start, count)
      except Exception as e:  # pylint: disable=broad-except
        error = f"{type(e).__name__}: {e}"
      try:
        self._queues.results[owner].put((task_id, elements, error))
      except (EOFError, OSError, ValueError) as e:
        log.warning("head task of worker %d not answered: %s", owner, e)


class _Failed:
  """An element whose computation raised: the iterator computes it again
  when it reaches it, so the error (the genuine one, not pickled) surfaces
  at that element's step, and the elements before it are served."""


FAILED = _Failed()


def _elements(head: grain.MapDataset, start: int, count: int) -> list[Any]:
  """head[start : start+count], None for what the pipeline filtered out,
  FAILED for what raised."""
  out: list[Any] = []
  for i in range(start, min(start + count, len(head))):
    try:
      out.append(head[i])
    except Exception:  # pylint: disable=broad-except
      out.append(FAILED)
  return out


class ParallelHead(grain.IterDataset):
  """`head.to_iter_dataset()`, its elements computed in tasks by `fetch`
  (start, count) -> Future of a list of elements, `ahead` tasks ahead."""

  def __init__(self, head: grain.MapDataset,
               fetch: Callable[[int, int], concurrent.futures.Future], *, ahead: int):
    super().__init__()
    self._head = head
    self._fetch = fetch
    self._ahead = ahead

  def __iter__(self) -> grain.DatasetIterator:
    return _ParallelHeadIterator(self._head, self._fetch, self._ahead)


class _ParallelHeadIterator(grain.DatasetIterator):

  def __init__(self, head: grain.MapDataset,
               fetch: Callable[[int, int], concurrent.futures.Future], ahead: int):
    super().__init__()
    self._head = head
    self._fetch = fetch
    self._ahead = max(1, ahead)
    self._next = 0  # the index after the last element returned
    self._tasks: dict[int, concurrent.futures.Future] = {}  # first index -> elements
    self._elements: list[Any] | None = None
    self._elements_start = -1

  def _task_start(self, index: int) -> int:
    return index - index % TASK_ELEMENTS

  def _ensure_ahead(self, index: int) -> None:
    first = self._task_start(index)
    end = len(self._head)
    for k in range(self._ahead):
      start = first + k * TASK_ELEMENTS
      if start >= end:
        break
      if start not in self._tasks:
        self._tasks[start] = self._fetch(start, TASK_ELEMENTS)
    for start in [s for s in self._tasks if s < first]:
      del self._tasks[start]

  def _load(self, start: int) -> list[Any]:
    future = self._tasks[start]
    try:
      return future.result(timeout=TASK_TIMEOUT_S)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("head elements %d-%d not computed by another worker (%s): computing "
                  "them here", start, start + TASK_ELEMENTS - 1,
                  "no answer in time" if isinstance(e, concurrent.futures.TimeoutError) else e)
      return future.local()  # type: ignore[attr-defined]

  def __next__(self) -> Any:
    end = len(self._head)
    while self._next < end:
      start = self._task_start(self._next)
      if self._elements_start != start:
        self._ensure_ahead(self._next)
        self._elements = self._load(start)
        self._elements_start = start
      element = self._elements[self._next - start]
      if isinstance(element, _Failed):
        element = self._head[self._next]  # raises, as it did where it was computed
      self._next += 1
      if element is not None:
        return element
    raise StopIteration

  def get_state(self) -> dict[str, Any]:
    return {"next_index": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    index = state["next_index"]
    if not isinstance(index, int) or not 0 <= index <= len(self._head):
      raise ValueError(f"next_index {index!r} is out of the head's range [0, {len(self._head)}]")
    self._next = index
    self._tasks.clear()
    self._elements, self._elements_start = None, -1
