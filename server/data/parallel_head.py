"""A stream's head computed across the server's worker processes.

A stream dataset (stream.py) is one pipeline: its head, `pipeline(records)`
(read, decode, tokenize, filter, flat_map), is random access by index and
costs most of the CPU; what follows it (pack, batch) is sequential and
cheap. Every chunk of a stream is served by one worker (the client routes
them there), so that its Grain iterator goes on where the last chunk ended;
alone, that worker would do all the work on one core. Instead its head
iterator asks for the elements ahead of it in tasks of consecutive indices,
dealt in turn to every worker of the server (itself included), each of
which computes them from its own copy of the dataset: the same elements,
whoever computes them, since an element depends on its index alone.

Workers meet on Unix sockets in a private directory of the supervisor's
(`HeadPeers`), one listening socket per worker index, each connection
authenticated with the server's key; nothing crosses the network, so
pickling is safe here. A connection is one pair of processes and nothing
else: when either dies, the other sees the connection close at once, fails
the tasks it had sent there (the owner then computes them itself) and dials
the restarted worker later; no lock or buffer is shared by a third process,
which a worker SIGKILLed in the middle of a write could leave broken for
all. A task not answered within TASK_TIMEOUT_S (its worker hangs) is
computed by the owner too.

`ParallelHead` yields exactly what Grain's `to_iter_dataset()` yields, with
the same state ({"next_index": i}), so positions from either continue in
the other.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing.connection as mpc
import os
import shutil
import tempfile
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
# How long a worker that could not be reached is left alone before it is dialled again.
_REDIAL_S = 1.0
# The longest AF_UNIX path Linux takes (sun_path is 108 bytes, NUL included).
_MAX_SOCKET_PATH = 107


class HeadPeers:
  """Where the server's workers meet: a private directory (mode 0700) with
  one socket per worker index, and the key that authenticates them. Made by
  the supervisor, handed to every worker it spawns (restarts included)."""

  def __init__(self, num_workers: int):
    self.num_workers = num_workers
    self.directory = tempfile.mkdtemp(prefix="elevator-head-")
    if len(self.address(num_workers)) > _MAX_SOCKET_PATH:
      # A long TMPDIR (a CI runner's, a pod's) would make the socket path
      # longer than AF_UNIX allows; /tmp is short everywhere.
      os.rmdir(self.directory)
      self.directory = tempfile.mkdtemp(prefix="elevator-head-", dir="/tmp")
    self.authkey = os.urandom(32)

  def address(self, index: int) -> str:
    return os.path.join(self.directory, f"{index}.sock")

  def remove(self) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)


class HeadService:
  """One worker's part: answers the other workers' tasks (a thread per
  connection), and deals its own streams' tasks to every worker."""

  def __init__(self, peers: HeadPeers, index: int, datasets: Any):
    self._peers = peers
    self._index = index
    self._datasets = datasets
    self._ids = itertools.count()
    self._turn = itertools.count(index)
    self._local = concurrent.futures.ThreadPoolExecutor(1, "elevator-head-local")
    self._others = {j: _Peer(peers.address(j), peers.authkey)
                    for j in range(peers.num_workers) if j != index}
    address = peers.address(index)
    if os.path.exists(address):  # this index's earlier life
      os.unlink(address)
    self._listener = mpc.Listener(address, family="AF_UNIX", authkey=peers.authkey)
    threading.Thread(target=self._accept, name="elevator-head-accept", daemon=True).start()

  def stop(self) -> None:
    self._listener.close()
    for peer in self._others.values():
      peer.close()
    self._local.shutdown(wait=False, cancel_futures=True)

  @property
  def elements_held(self) -> int:
    """Head elements one iterator keeps: the tasks ahead and the current one."""
    return (TASKS_AHEAD_PER_WORKER * self._peers.num_workers + 1) * TASK_ELEMENTS

  def factory(self, dataset: str, fingerprint: str) -> Callable[[grain.MapDataset], Any]:
    """The head factory of one stream dataset (StreamDataset.use_head)."""
    def make(head: grain.MapDataset) -> grain.IterDataset:
      return ParallelHead(head, lambda start, count: self._submit(
          dataset, fingerprint, head, start, count),
          ahead=TASKS_AHEAD_PER_WORKER * self._peers.num_workers)
    return make

  def _submit(self, dataset: str, fingerprint: str, head: grain.MapDataset, start: int,
              count: int) -> concurrent.futures.Future:
    """Deals the task to the next worker in turn that can take it; the
    future's `local` computes it here (the fallback of every failure)."""
    task = (next(self._ids), dataset, fingerprint, start, count)
    future = None
    for _ in range(self._peers.num_workers):
      peer = self._others.get(next(self._turn) % self._peers.num_workers)
      if peer is None:  # this worker's turn
        break
      future = peer.submit(task)
      if future is not None:
        break
    if future is None:
      future = self._local.submit(_elements, head, start, count)
    future.local = lambda: _elements(head, start, count)  # type: ignore[attr-defined]
    return future

  def _accept(self) -> None:
    while True:
      try:
        conn = self._listener.accept()
      except (OSError, EOFError, mpc.AuthenticationError) as e:
        if isinstance(e, mpc.AuthenticationError):
          log.warning("a head connection failed authentication: %s", e)
          continue
        return  # stopped
      threading.Thread(target=self._answer, args=(conn,), name="elevator-head-answer",
                       daemon=True).start()

  def _answer(self, conn: mpc.Connection) -> None:
    """Computes one other worker's tasks, in the order they come."""
    with conn:
      while True:
        try:
          task_id, dataset, fingerprint, start, count = conn.recv()
        except (EOFError, OSError):
          return
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
          conn.send((task_id, elements, error))
        except (OSError, ValueError):
          return


class _Peer:
  """Another worker as seen from this one: a connection dialled when a
  task is first sent there, its answers read by a thread of its own."""

  def __init__(self, address: str, authkey: bytes):
    self._address = address
    self._authkey = authkey
    self._lock = threading.Lock()
    self._conn: mpc.Connection | None = None
    self._dialling = False
    self._redial_at = 0.0
    self._pending: dict[int, concurrent.futures.Future] = {}
    self._closed = False

  def submit(self, task: tuple[Any, ...]) -> concurrent.futures.Future | None:
    """The future of `task` sent to this worker; None while it cannot take
    it (not dialled yet, restarting, gone)."""
    with self._lock:
      if self._conn is None:
        if not self._dialling and not self._closed and time.monotonic() >= self._redial_at:
          self._dialling = True
          threading.Thread(target=self._dial, name="elevator-head-dial", daemon=True).start()
        return None
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._pending[task[0]] = future
      try:
        self._conn.send(task)
      except (OSError, ValueError):
        del self._pending[task[0]]
        return None  # the reader sees the connection close and cleans up
      return future

  def close(self) -> None:
    with self._lock:
      self._closed = True
      conn = self._conn
    if conn is not None:
      conn.close()

  def _dial(self) -> None:
    """Connects (authentication may wait on the peer: not under the lock),
    then reads answers until the connection closes."""
    try:
      conn = mpc.Client(self._address, family="AF_UNIX", authkey=self._authkey)
    except (OSError, EOFError, mpc.AuthenticationError):
      with self._lock:
        self._dialling, self._redial_at = False, time.monotonic() + _REDIAL_S
      return
    with self._lock:
      self._conn, self._dialling = conn, False
    try:
      while True:
        task_id, elements, error = conn.recv()
        with self._lock:
          future = self._pending.pop(task_id, None)
        if future is None:
          continue
        if error:
          future.set_exception(RuntimeError(error))
        else:
          future.set_result(elements)
    except (EOFError, OSError):
      pass
    with self._lock:
      self._conn, self._redial_at = None, time.monotonic() + _REDIAL_S
      pending, self._pending = self._pending, {}
    conn.close()
    for future in pending.values():  # the owner computes them itself
      future.set_exception(ConnectionError(f"{self._address} closed"))


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
