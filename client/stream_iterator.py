"""A stream dataset's iterator: its steps in order, from a stream position.

A stream dataset (server/data/streams/stream.py) finds global batch k from the
position of its Grain pipeline where k starts, not from k: a request names
that position, and every step arrives with the position after it. So
requests follow one another: a fetch thread asks for the next chunk as soon
as the last step of the one before has arrived, from where it ended, and
keeps up to `prefetch` steps ahead of the trainer. One request is in flight
at a time, to the one worker that owns the stream, so neither more
connections nor a wider window make it faster (the server spreads the
stream's work over its workers itself: server/data/streams/parallel_head.py); the
default window is fixed at window.STREAM_REQUESTS requests ahead. Chunks end at multiples
of their size, as for any dataset, so every host of a job asks for the same
chunks and the server produces each global batch once for all of them.

The state is the step and the position of the next step to deliver (Grain's
own iterator state, JSON), so a job resumes, on any number of hosts and any
replica, exactly where it stopped; a new G continues from the position.
The stream's end arrives as OUT_OF_RANGE after its last batch: StopIteration.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from grain_elevator.client import state as state_lib
from grain_elevator.client import window as window_lib
from grain_elevator.client.backend import Backend
from grain_elevator.client.iterator import Arrivals, ClientIterator
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.client.transport.connection import CancelToken
from grain_elevator.proto import contract
from grain_elevator.proto.errors import ElevatorError, EndOfDataError, InvalidRequestError
from grain_elevator.proto import limits

_END = object()  # the stream ended after the steps before it
# Rows one Skip call fast-forwards past at most (G of them per step): each
# call is one request under RetryPolicy.request_timeout_s.
SKIP_ROWS_PER_CALL = limits.MAX_SKIP_ROWS


class StreamIterator(ClientIterator):
  """Delivers a stream dataset's steps in order, `prefetch` of them ahead."""

  def __init__(self, spec: ReadSpec, backend: Backend):
    """`spec`: what it reads (a dataset of Kind.STREAM, described)."""
    # Fixed: one fetch thread, one request at a time, whatever the workers.
    window = window_lib.for_dataset(spec, window_lib.STREAM_REQUESTS, adaptive=False)
    ahead = max(window.prefetch, window.steps_per_request)
    super().__init__(spec, backend, lambda: ahead)
    self._window = window
    self._ahead = ahead  # steps the fetch thread keeps ahead of the trainer
    self._position = self._info.stream_start  # where the next step starts
    self._skip_token: CancelToken | None = None  # a skip's server calls, while one runs
    self._cond = threading.Condition()
    self._queue: collections.deque[Any] = collections.deque()  # Steps, then _END or an error
    self._fetcher: threading.Thread | None = None
    self._token: CancelToken | None = None
    self._stopped = False

  # -- fetching -------------------------------------------------------------

  def _start(self) -> None:
    self._stopped = False
    self._token = CancelToken()
    self._fetcher = threading.Thread(
        target=self._fetch, args=(self._step, self._position, self._token),
        name="grain-elevator-stream", daemon=True)
    self._fetcher.start()

  def _stop(self) -> None:
    """Ends the fetch thread and forgets what it fetched ahead."""
    self._stop_fetcher()
    self._join()

  def _stop_fetcher(self) -> None:
    with self._cond:
      self._stopped = True
      self._cond.notify_all()
    if self._token is not None:
      self._token.cancel()

  def _join(self) -> None:
    if self._fetcher is not None:
      self._fetcher.join()
    self._fetcher = self._token = None
    self._queue.clear()

  def _cancel(self) -> None:
    token = self._skip_token
    if token is not None:
      token.cancel()
    self._stop_fetcher()

  def _fetch(self, step: int, position: str, token: CancelToken) -> None:
    """The fetch thread: chunk after chunk, each from where the last ended."""
    per_request = self._window.steps_per_request
    ahead = self._ahead
    try:
      while True:
        n = per_request - step % per_request  # chunks end at multiples of their size
        with self._cond:
          while not self._stopped and len(self._queue) + n > ahead and self._queue:
            self._cond.wait()
          if self._stopped:
            return
        out = Arrivals(self._put)
        request = self._request(step, n, stream_state=position)
        try:
          self._backend.fetch(request, token, out)
        except EndOfDataError:
          self._put(_END)
          return
        step += len(out)
        position = out[-1].next_stream_state
    except BaseException as e:  # pylint: disable=broad-except
      if not token.cancelled:  # a Cancelled we did not ask for is an error too
        self._put(e)

  def _put(self, item: Any) -> None:
    with self._cond:
      if not self._stopped:
        self._queue.append(item)
        self._cond.notify_all()

  # -- the iterator ---------------------------------------------------------

  def __next__(self) -> Any:
    called_at = time.monotonic()
    with self._cond:
      self._check_open()
    if self._fetcher is None:
      if self._queue and self._queue[0] is _END:
        raise StopIteration
      self._start()
    with self._cond:
      while not self._queue:
        fetcher = self._fetcher
        if fetcher is None or not fetcher.is_alive():  # it puts before it ends, under this lock
          raise ElevatorError(f"{self._spec}: the fetch thread ended with nothing to deliver")
        self._cond.wait(1.0)
      item = self._queue[0]
      if item is _END:
        raise StopIteration
      if isinstance(item, BaseException):
        raise item
      self._queue.popleft()
      self._cond.notify_all()  # room for the next chunk
    self._step += 1
    self._position = item.next_stream_state
    return self._delivered(called_at, item.leaves)

  # -- skipping -------------------------------------------------------------

  def skip(self, num_steps: int) -> None:
    """Drops the next `num_steps` global batches (rollback-and-skip): the
    server moves the stream's position past them without sending any (one
    Skip call per SKIP_ROWS_PER_CALL rows), and the cursor records the
    range. InvalidRequestError for a count below 0, or one past the end of
    a finite stream (the iterator then stays where it was)."""
    self._check_open()
    contract.check_skip(self._step, num_steps, self._spec.global_batch_size,
                        dataset=self._spec.dataset)
    skips = state_lib.add_skip(self._skips, self._step, num_steps)
    self._stop()
    position = self._fast_forward(self._step, self._position, num_steps)
    self._step, self._position, self._skips = self._step + num_steps, position, skips

  def _fast_forward(self, step: int, position: str, num_steps: int) -> str:
    """The position `num_steps` global batches after `position` (at `step`)."""
    token = self._skip_token = CancelToken()
    try:
      return fast_forward(self._backend, self._spec, step, position, num_steps, token)
    finally:
      self._skip_token = None

  # -- checkpointing --------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return self._state(state_lib.Cursor(self._step, stream_state=self._position,
                                        skips=self._skips))

  def set_state(self, state: dict[str, Any]) -> None:
    cursor = self._cursor(state)
    self._stop()
    step, position = cursor.step, cursor.stream_state
    if cursor.pending is not None:  # a skip written into the state: make it now
      position = self._fast_forward(step, position or self._info.stream_start,
                                    cursor.pending - step)
      step = cursor.pending
    self._step, self._position, self._skips = step, position, cursor.skips


def fast_forward(backend: Backend, spec: ReadSpec, step: int, position: str,
                 num_steps: int, token: CancelToken) -> str:
  """The position of the stream `spec` reads (described) `num_steps` global
  batches after `position` (where `step` starts), found by the servers
  without sending any batch: one Skip call per SKIP_ROWS_PER_CALL rows.
  InvalidRequestError if the stream ends first."""
  per_call = limits.skip_steps(spec.global_batch_size)
  end = step + num_steps
  while step < end:
    n = min(per_call, end - step)
    try:
      position = backend.skip(spec.request(step, n, stream_state=position), token)
    except EndOfDataError as e:
      raise InvalidRequestError(
          f"{spec}: a skip of {num_steps} steps from step {end - num_steps} passes the "
          f"end of the stream ({e}); the iterator stays at step {end - num_steps}") from None
    step += n
  return position
