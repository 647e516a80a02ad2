"""The reader of a dataset that answers for any step (1:1 and mixtures).

Steps are asked for in chunks (requests of `steps_per_request`: a short
time of a server worker's work, client/request_size.py), several in flight
over the pool's connections and replicas (client/transport/pool.py), up to
`prefetch` steps ahead of the trainer, and delivered in step order, each
as soon as it has arrived. Chunks end at multiples of their size,
whatever step the trainer resumed at, so trainers of one request size ask
for the same chunks and the worker that owns one serves it once. A skip or a restored
cursor is O(1): the cursor is a step (and the records before step 0).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Any

from grain_elevator.client import request_size
from grain_elevator.client import state as state_lib
from grain_elevator.client import window as window_lib
from grain_elevator.client.backend import Backend
from grain_elevator.client.iterator import Arrivals, ClientIterator
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.client.transport.connection import CancelToken, Step
from grain_elevator.proto import contract
from grain_elevator.proto.errors import Cancelled, ElevatorError


@dataclasses.dataclass(frozen=True)
class _Chunk:
  start: int
  num_steps: int
  steps: Arrivals
  future: concurrent.futures.Future
  token: CancelToken


class StepIterator(ClientIterator):
  """Delivers steps in order while keeping `prefetch` of them in flight."""

  def __init__(self, spec: ReadSpec, backend: Backend):
    """`spec`: what it reads (a dataset of Kind.STEP, described)."""
    # Everything that can refuse (G against the dataset) before the skeleton
    # starts: a half-made iterator would reach the closing thread.
    total = spec.require_info().total_steps(spec.global_batch_size)
    by_bytes = window_lib.for_dataset(spec, backend.parallelism)
    # Sized by the workers' time unless the trainer fixed it (or no worker says).
    size = request_size.RequestSize(by_bytes.steps_per_request, timed=backend.times_steps
                                    and spec.transport.steps_per_request is None)
    window = window_lib.for_dataset(spec, backend.parallelism, steps_per_request=size.steps)
    # None: a window the user fixed (prefetch given)
    tune = window_lib.Autotune(window) if window.adaptive else None
    super().__init__(spec, backend, (lambda: tune.prefetch) if tune is not None
                     else (lambda: window.prefetch))
    self._window, self._tune, self._size = window, tune, size
    # Fetch threads: the window's requests at its first size (the smallest),
    # but no more than its requests by bytes or GROWTH for every connection
    # (requests beyond would only queue for one).
    def requests(w: window_lib.Window) -> int:
      return -(-max(w.prefetch, w.most) // w.steps_per_request)
    self._threads = max(1, min(requests(window), max(
        requests(by_bytes), window_lib.GROWTH * backend.parallelism)))
    self._offset = 0  # records before step 0: nonzero once G changed at a checkpoint
    self._total = total
    self._requested = 0  # first step not yet requested
    self._chunks: collections.deque[_Chunk] = collections.deque()
    self._lock = threading.Lock()
    self._arrived = threading.Condition()  # a step arrived or a fetch ended
    self._awaited: int | None = None  # the chunk (its start) the trainer waits on
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None

  @property
  def _prefetch(self) -> int:
    """Steps to keep in flight now."""
    return self._tune.prefetch if self._tune is not None else self._window.prefetch

  # -- fetching -------------------------------------------------------------

  def _fill(self) -> None:
    """Requests steps until `prefetch` (at least 1) are in flight."""
    prefetch, per_request = self._prefetch, self._window.steps_per_request
    limit = self._step + max(1, prefetch)
    if self._total is not None:
      limit = min(limit, self._total)
    if self._requested < limit and self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=self._threads, thread_name_prefix="grain-elevator-fetch")
    while self._requested < limit:
      # Requests end at multiples of their size, whatever step the trainer
      # resumed at: trainers then ask for the same chunks, which the same
      # worker serves once (server/serving/batch_cache.py).
      whole = per_request - self._requested % per_request
      n = min(whole, limit - self._requested)
      if n < whole and self._requested > self._step and (
          self._total is None or self._requested + n < self._total):
        break  # steps are in flight: wait until a whole request fits the window
      token = CancelToken()
      wake = functools.partial(self._wake, self._requested)
      steps = Arrivals(wake)
      request = self._request(self._requested, n, record_offset=self._offset,
                              timed=self._size.timed)
      future = self._pool.submit(self._backend.fetch, request, token, steps)
      future.add_done_callback(wake)
      self._chunks.append(_Chunk(self._requested, n, steps, future, token))
      self._requested += n

  def _wake(self, start: int, _: Step | concurrent.futures.Future) -> None:
    """A step of the chunk at `start` arrived, or its fetch ended: the
    trainer is woken only if it waits on that chunk: with many chunks in
    flight, most arrivals are for others (BENCHMARKS.md, the client's CPU)."""
    if self._awaited == start:  # set under the lock before the trainer checks
      with self._arrived:
        self._arrived.notify_all()

  def _resize(self, production_s: float) -> None:
    """A step said how long it took to make: requests follow it
    (client/request_size.py), and the window with them."""
    if self._size.observe(production_s):
      self._window = window_lib.for_dataset(self._spec, self._backend.parallelism,
                                            steps_per_request=self._size.steps)
      if self._tune is not None:
        self._tune.resize(self._window)

  def _take(self, chunk: _Chunk, i: int) -> Step:
    """Step `i` of `chunk` once it has arrived; the fetch's error if it failed first."""
    with self._arrived:
      self._awaited = chunk.start
      while len(chunk.steps) <= i and not chunk.future.done():
        self._arrived.wait()
      self._awaited = None
    if len(chunk.steps) > i:
      taken = chunk.steps[i]
      # The trainer's now, not the window's; the position stays (a retry continues from it).
      chunk.steps[i] = Step([], taken.next_stream_state)
      return taken
    chunk.future.result()  # raises what ended the fetch
    raise ElevatorError(f"{self._spec}: step {chunk.start + i} was not received")

  def _cancel_all(self) -> None:
    while self._chunks:
      chunk = self._chunks.popleft()
      chunk.token.cancel()
      chunk.future.cancel()
    self._requested = self._step

  # -- the iterator ---------------------------------------------------------

  def __next__(self) -> Any:
    called_at = time.monotonic()
    with self._lock:
      self._check_open()
      if self._total is not None and self._step >= self._total:
        self._stop_pool()  # Ended: leave no threads behind.
        raise StopIteration
      self._fill()
      chunk = self._chunks[0]
      i = self._step - chunk.start
      if self._tune is not None:  # arrived and untaken, this step included
        ready = sum(len(c.steps) for c in self._chunks) - i
        waited = len(chunk.steps) <= i
      try:
        taken = self._take(chunk, i)
      except Cancelled:
        raise Cancelled(f"{self._spec} iterator was closed") from None
      if self._step == chunk.start + chunk.num_steps - 1:
        self._chunks.popleft()
      self._step += 1
      if self._tune is not None:
        self._tune.observe(waited, ready)
      self._resize(taken.production_s)
      if self._window.prefetch:
        self._fill()  # keep the window full while the trainer works
    return self._delivered(called_at, taken.leaves)

  def skip(self, num_steps: int) -> None:
    """Drops the next `num_steps` global batches (rollback-and-skip), in
    O(1): the cursor records the range, so every host and every later
    checkpoint continues the same stream. InvalidRequestError for a count
    below 0, or one past the end of a finite dataset."""
    with self._lock:
      self._check_open()
      g = self._spec.global_batch_size
      contract.check_skip(self._step, num_steps, g, self._offset, self._total,
                          self._spec.dataset)
      skips = state_lib.add_skip(self._skips, self._step, num_steps)
      self._cancel_all()
      if self._tune is not None:
        self._tune.restart()
      self._skips = skips
      self._step = self._requested = self._step + num_steps

  # -- checkpointing --------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return self._state(state_lib.Cursor(self._step, self._offset, skips=self._skips))

  def set_state(self, state: dict[str, Any]) -> None:
    cursor = self._cursor(state)
    with self._lock:
      self._cancel_all()
      if self._tune is not None:
        self._tune.restart()
      self._step = self._requested = cursor.step
      self._skips = cursor.skips
      self._offset = cursor.record_offset
      self._total = self._info.total_steps(self._spec.global_batch_size, self._offset)

  # -- life -----------------------------------------------------------------

  def _stop_pool(self) -> None:
    pool, self._pool = self._pool, None
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)

  def _cancel(self) -> None:
    # Tokens first, without the lock: a __next__ blocked on a fetch holds it.
    for chunk in list(self._chunks):
      chunk.token.cancel()
    with self._lock:
      self._cancel_all()

  def _join(self) -> None:
    with self._lock:
      self._stop_pool()
