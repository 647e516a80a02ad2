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
(`Peers`, which server/process/head_sockets.py's `HeadPeers` is), one
listening socket per worker index, each connection authenticated with the
server's key (a handshake that fails or stalls past HEAD_HANDSHAKE_TIMEOUT_S
closes that connection, never the accept loop, and dials time out too); nothing crosses the network, so
pickling is safe here. A connection is one pair of processes and nothing
else: no lock or buffer is shared by a third process, which a worker
SIGKILLed in the middle of a write could leave broken for all.

What the owner of a stream does when a peer fails it, so that the stream
goes on, exact (an element is the same bytes whoever computes it):
- A peer that dies: its connection closes at once; the owner computes the
  tasks it had sent there itself, and dials it again (every REDIAL_S while
  it deals tasks) until the restarted worker answers.
- A peer that hangs (SIGSTOP, a pipeline stuck in a call): a worker
  computing a task sends a progress note at least every PROGRESS_EVERY_S
  (between elements), so a peer with tasks outstanding that has sent
  nothing for PEER_SILENT_S is hung, not slow. The owner closes its
  connection and computes its tasks itself; dealing skips the peer until a
  dial's handshake succeeds again, that is until it runs again.
- A peer that raises computing a task (another fingerprint): the owner
  computes that task itself.
Each of those is one log line (at most one per HEAD_LOG_PERIOD_S for each
peer and kind), and `Counts` (the server's metrics) counts the tasks each
worker computed for each owner, and those the owner took back.

`ParallelHead` yields exactly what Grain's `to_iter_dataset()` yields, with
the same state ({"next_index": i}), so positions from either continue in
the other.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing.connection as mpc
import multiprocessing.reduction
import threading
import time
from typing import Any, Callable, Protocol

import grain

from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.data.streams import head_reads

log = logging.getLogger("grain_elevator.server")

# Consecutive head indices per task (the block whose reads are planned
# together), and tasks kept in flight per worker.
TASK_ELEMENTS = head_reads.BLOCK
TASKS_AHEAD_PER_WORKER = 2
# A worker computing a task tells its owner it is alive at least this often.
PROGRESS_EVERY_S = 0.5
# A peer with tasks outstanding that sends nothing (no answer, no progress
# note) for this long is hung: its tasks are computed by their owner, and it
# is dealt none until it answers a dial again. Ten progress notes missed: a
# busy peer under load is slow, not silent.
PEER_SILENT_S = 5.0
# How long a worker that could not be reached is left alone before it is dialled again.
REDIAL_S = 1.0
# How often a connection with nothing to read checks its peer's silence.
_POLL_S = 0.25
# One log line per period for each peer and kind of failure (the head
# sockets' failed handshakes too).
HEAD_LOG_PERIOD_S = 10.0
# A progress note: an answer to no task.
_PROGRESS = (None, None, "")

_throttled = Throttled(HEAD_LOG_PERIOD_S, log)


class Listening(Protocol):
  def close(self) -> None: ...


class Peers(Protocol):
  """Where the server's workers meet (server/process/head_sockets.py's
  HeadPeers): each listens on a socket of its own, the others dial it."""

  num_workers: int

  def listen(self, index: int, serve: Callable[[mpc.Connection], None], *,
             send_timeout_s: float | None) -> Listening: ...
  def dial(self, index: int, *, recv_timeout_s: float | None,
           send_timeout_s: float | None) -> mpc.Connection: ...
  def shutdown(self, conn: mpc.Connection) -> None: ...
  def describe(self, e: BaseException) -> str: ...


class Counts:
  """What the parallel head counts (the server's metrics implement it):
  tasks of `owner`'s streams computed by `worker`, and tasks dealt to
  `worker` that `owner` computed itself. Here: nothing."""

  def head_task(self, owner: int, worker: int) -> None:
    pass

  def head_fallback(self, owner: int, worker: int) -> None:
    pass


class PeerLost(ConnectionError):
  """The task's worker died, hung or was stopped before it answered (logged
  once by its `_Peer`)."""


class _OwnerGone(Exception):
  """A task's owner no longer reads its answers."""


class HeadService:
  """One worker's part: answers the other workers' tasks (a thread per
  connection), and deals its own streams' tasks to every worker."""

  def __init__(self, peers: Peers, index: int, datasets: Any,
               counts: Counts | None = None):
    self._peers = peers
    self._index = index
    self._datasets = datasets
    self._counts = counts if counts is not None else Counts()
    self._ids = itertools.count()
    self._turn = itertools.count(index)
    self._local = concurrent.futures.ThreadPoolExecutor(1, "elevator-head-local")
    self._others = {j: _Peer(j, index, peers, self._counts)
                    for j in range(peers.num_workers) if j != index}
    self._listener = peers.listen(index, self._answer, send_timeout_s=PEER_SILENT_S)

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
    future's `local` computes it here (the fallback of every failure), its
    `worker` is the index of the worker it was dealt to."""
    task = (next(self._ids), dataset, fingerprint, start, count)
    future, worker = None, self._index
    for _ in range(self._peers.num_workers):
      j = next(self._turn) % self._peers.num_workers
      peer = self._others.get(j)
      if peer is None:  # this worker's turn
        break
      future = peer.submit(task)
      if future is not None:
        worker = j
        break
    reads = self._reads(dataset, fingerprint)
    if future is None:
      if reads is not None:  # its reads go out while the tasks before it compute
        reads.plan(start, count)
      future = self._local.submit(self._here, head, start, count, reads)

    def local() -> list[Any]:
      if worker != self._index:
        self._counts.head_fallback(self._index, worker)
      return self._here(head, start, count, reads)

    future.local = local  # type: ignore[attr-defined]
    future.worker = worker  # type: ignore[attr-defined]
    return future

  def _here(self, head: grain.MapDataset, start: int, count: int,
            reads: head_reads.HeadReads | None) -> list[Any]:
    elements = _elements(head, start, count, reads=reads)
    self._counts.head_task(self._index, self._index)
    return elements

  def _reads(self, dataset: str, fingerprint: str) -> head_reads.HeadReads | None:
    """The stream's planner of head reads: None where nothing is in a bucket."""
    try:
      return getattr(self._stream(dataset, fingerprint), "head_reads", None)
    except Exception:  # pylint: disable=broad-except
      return None  # refused here: the task's computation meets that

  def _stream(self, dataset: str, fingerprint: str) -> Any:
    """The stream of `dataset` whose fingerprint is `fingerprint`: the
    dataset, or one of its sub-streams (sub_streams.py); RuntimeError if
    none has it here (another config)."""
    ds = self._datasets.get(dataset)
    for stream in getattr(ds, "parts", [ds]):
      if stream.info.config_fingerprint == fingerprint:
        return stream
    raise RuntimeError(f"dataset {dataset!r} has no stream of fingerprint {fingerprint} "
                       f"here (its fingerprint is {ds.info.config_fingerprint})")

  def _answer(self, conn: mpc.Connection) -> None:
    """Computes one other worker's tasks, in the order they come, with a
    progress note at least every PROGRESS_EVERY_S while computing."""
    with conn:
      sent = time.monotonic()

      def note() -> None:
        nonlocal sent
        if time.monotonic() - sent >= PROGRESS_EVERY_S:
          try:
            conn.send(_PROGRESS)
          except OSError as e:
            raise _OwnerGone() from e
          sent = time.monotonic()

      while True:
        try:
          task_id, dataset, fingerprint, start, count = conn.recv()
        except Exception:  # pylint: disable=broad-except
          return  # closed (EOFError, OSError) or not a task: this peer is done
        elements, error = None, ""
        sent = time.monotonic()
        try:
          ds = self._stream(dataset, fingerprint)
          elements = _elements(ds.head, start, count, note, getattr(ds, "head_reads", None))
        except _OwnerGone:
          return  # a progress note could not be sent: the owner is gone or hung
        except Exception as e:  # pylint: disable=broad-except
          error = f"{type(e).__name__}: {e}"
        try:
          payload = _pickled((task_id, elements, error))
        except Exception as e:  # pylint: disable=broad-except
          payload = _pickled((task_id, None, f"cannot send the elements: {type(e).__name__}: {e}"))
        try:
          conn.send_bytes(payload)
          sent = time.monotonic()
        except (OSError, ValueError):
          return


class _Peer:
  """Another worker as seen from the one at index `owner`: a connection
  dialled when a task is first sent there, its answers read by a thread of
  its own, which also watches the peer's silence. Thread-safe; `_lock`
  guards `_conn`, `_dialling`, `_redial_at`, `_pending`, `_heard`."""

  def __init__(self, index: int, owner: int, peers: Peers, counts: Counts):
    self.index = index
    self._owner = owner
    self._peers = peers
    self._counts = counts
    self._lock = threading.Lock()
    self._conn: mpc.Connection | None = None
    self._dialling = False
    self._redial_at = 0.0
    self._pending: dict[int, concurrent.futures.Future] = {}
    # When the peer last sent anything, or was given work while it had none:
    # its silence counts from there.
    self._heard = 0.0
    self._hung = False  # it went silent; said when it answers again
    self._closed = False

  def submit(self, task: tuple[Any, ...]) -> concurrent.futures.Future | None:
    """The future of `task` sent to this worker; None while it cannot take
    it (not dialled yet, restarting, gone, hung)."""
    with self._lock:
      if self._conn is None:
        if not self._dialling and not self._closed and time.monotonic() >= self._redial_at:
          self._dialling = True
          threading.Thread(target=self._dial, name="elevator-head-dial", daemon=True).start()
        return None
      future: concurrent.futures.Future = concurrent.futures.Future()
      if not self._pending:
        self._heard = time.monotonic()
      self._pending[task[0]] = future
      try:
        self._conn.send(task)
      except (OSError, ValueError):
        del self._pending[task[0]]
        self._peers.shutdown(self._conn)  # a message may be cut: the reader ends it
        return None
      return future

  def close(self) -> None:
    with self._lock:
      self._closed = True
      conn = self._conn
    if conn is not None:
      self._peers.shutdown(conn)

  def _dial(self) -> None:
    """Connects (authentication may wait on the peer: not under the lock),
    then reads answers until the connection ends; then fails the tasks
    still outstanding, so that their owner computes them."""
    try:
      conn = self._peers.dial(self.index, recv_timeout_s=PEER_SILENT_S,
                              send_timeout_s=PEER_SILENT_S)
    except Exception:  # pylint: disable=broad-except
      with self._lock:  # not there (restarting), or not answering (hung): later
        self._dialling, self._redial_at = False, time.monotonic() + REDIAL_S
      return
    with self._lock:
      self._conn, self._dialling = conn, False
      hung, self._hung = self._hung, False
    if hung:
      log.info("head: worker %d answers again; dealing it tasks", self.index)
    why = self._read(conn)
    with self._lock:
      self._conn, self._redial_at = None, time.monotonic() + REDIAL_S
      pending, self._pending = self._pending, {}
      self._hung = why == "silent"
    conn.close()
    if why == "silent":
      _throttled.warning(
          ("silent", self.index), "head: worker %d sent nothing for %g s (PEER_SILENT_S) with "
          "%d tasks outstanding: computing them here; it is dealt none until it answers a "
          "dial again", self.index, PEER_SILENT_S, len(pending))
    elif pending and not self._closed:
      _throttled.warning(
          ("lost", self.index), "head: worker %d ended its connection (%s) with %d tasks "
          "outstanding: computing them here, and dialling it again", self.index, why,
          len(pending))
    for future in pending.values():
      future.set_exception(PeerLost(f"worker {self.index}: {why}"))

  def _read(self, conn: mpc.Connection) -> str:
    """Reads answers into their futures until the connection ends; returns
    why it ended ("silent": the peer is hung)."""
    try:
      while True:
        if not conn.poll(_POLL_S):
          with self._lock:
            silent = bool(self._pending) and time.monotonic() - self._heard > PEER_SILENT_S
          if silent:
            return "silent"
          if self._closed:
            return "stopped"
          continue
        # A message cut midway waits at most PEER_SILENT_S (the socket's timeout).
        task_id, elements, error = conn.recv()
        with self._lock:
          self._heard = time.monotonic()
          future = self._pending.pop(task_id, None) if task_id is not None else None
        if future is None:  # a progress note
          continue
        if error:
          future.set_exception(RuntimeError(error))
        else:
          self._counts.head_task(self._owner, self.index)
          future.set_result(elements)
    except BlockingIOError:
      return "silent"
    except Exception as e:  # pylint: disable=broad-except
      return self._peers.describe(e)


def _pickled(obj: Any) -> bytes:
  """What `Connection.send(obj)` sends; pickling first, so a failure leaves
  the connection whole."""
  return bytes(multiprocessing.reduction.ForkingPickler.dumps(obj))


class _Failed:

  """An element whose computation raised: the iterator computes it again
  when it reaches it, so the error (the genuine one, not pickled) surfaces
  at that element's step, and the elements before it are served."""


FAILED = _Failed()


def _elements(head: grain.MapDataset, start: int, count: int,
              progress: Callable[[], None] = lambda: None,
              reads: head_reads.HeadReads | None = None) -> list[Any]:
  """head[start : start+count], None for what the pipeline filtered out,
  FAILED for what raised; `progress()` after each element. `reads`: their
  records are in a bucket, read by plan (head_reads.py)."""
  out: list[Any] = []
  tag = reads.plan(start, count) if reads is not None else None
  try:
    for i in range(start, min(start + count, len(head))):
      try:
        out.append(head[i])
      except Exception:  # pylint: disable=broad-except
        out.append(FAILED)
      progress()
  finally:
    if reads is not None:
      reads.release(tag)
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


class _ParallelHeadIterator(head_reads.HeadIterator):

  def __init__(self, head: grain.MapDataset,
               fetch: Callable[[int, int], concurrent.futures.Future], ahead: int):
    super().__init__(head)
    self._fetch = fetch
    self._ahead = max(1, ahead)
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
    """The elements of the task at `start`: its answer, or, when its worker
    failed it, computed here. Every future ends: answered, failed by its
    connection's end, or by its worker's silence (PEER_SILENT_S)."""
    future = self._tasks[start]
    try:
      return future.result()
    except PeerLost:
      pass  # logged once for all its tasks
    except Exception as e:  # pylint: disable=broad-except
      worker = getattr(future, "worker", None)
      _throttled.warning(("failed", worker), "head: worker %s did not compute elements %d-%d "
                         "(%s): computing them here", worker, start,
                         start + TASK_ELEMENTS - 1, e)
    return future.local()  # type: ignore[attr-defined]

  def _element(self, index: int) -> Any:
    start = self._task_start(index)
    if self._elements_start != start:
      self._ensure_ahead(index)
      self._elements = self._load(start)
      self._elements_start = start
    element = self._elements[index - start]
    if isinstance(element, _Failed):
      element = self._head[index]  # raises, as it did where it was computed
    return element

  def _reset(self) -> None:
    self._tasks.clear()
    self._elements, self._elements_start = None, -1
