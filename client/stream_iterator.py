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

A stream of N sub-streams (server/data/streams/sub_streams.py) is read as N
such streams at once: a fetch thread per sub-stream, each sending its
requests to the worker its sub-stream routes to (client/transport/pool.py),
so N sub-streams keep up to N servers busy. Every host reads every
sub-stream, its rows there or none (a step with no rows still carries the
sub-stream's next position), so its cursor holds all N positions and
resumes on any H. A step is delivered once every sub-stream's has arrived,
this host's rows of each one after another. Training mode ends with the
first sub-stream that ends; evaluation mode goes on while any has a batch,
an ended one giving zero rows, masked out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Sequence

import numpy as np

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
    # Fixed: one fetch thread per sub-stream, one request at a time each,
    # whatever the workers.
    window = window_lib.for_dataset(spec, window_lib.STREAM_REQUESTS, adaptive=False)
    ahead = max(window.prefetch, window.steps_per_request)
    super().__init__(spec, backend, lambda: ahead)
    info = self._info
    self._shards = n = info.stream_shards
    contract.check_stream_shards(spec.global_batch_size, n, spec.dataset)
    self._window = window
    self._ahead = ahead  # steps each fetch thread keeps ahead of the trainer
    self._positions = list(info.starts)  # where each sub-stream's next step starts
    # This host's rows of each sub-stream's sub-batches (of the stream's batches for one).
    self._rows = [contract.sub_stream_rows(spec.global_batch_size, spec.shard_index,
                                           spec.shard_count, j, n) for j in range(n)]
    self._skip_token: CancelToken | None = None  # a skip's server calls, while one runs
    self._cond = threading.Condition()
    # Per sub-stream: its Steps, then _END or an error.
    self._queues: list[collections.deque[Any]] = [collections.deque() for _ in range(n)]
    self._fetchers: list[threading.Thread] = []
    self._token: CancelToken | None = None
    self._stopped = False

  # -- fetching -------------------------------------------------------------

  def _start(self) -> None:
    self._stopped = False
    self._token = CancelToken()
    self._fetchers = [threading.Thread(
        target=self._fetch, args=(j, self._step, self._positions[j], self._token),
        name=f"grain-elevator-stream-{j}", daemon=True) for j in range(self._shards)]
    for fetcher in self._fetchers:
      fetcher.start()

  def _stop(self) -> None:
    """Ends the fetch threads and forgets what they fetched ahead."""
    self._stop_fetcher()
    self._join()

  def _stop_fetcher(self) -> None:
    with self._cond:
      self._stopped = True
      self._cond.notify_all()
    if self._token is not None:
      self._token.cancel()

  def _join(self) -> None:
    for fetcher in self._fetchers:
      fetcher.join()
    self._fetchers, self._token = [], None
    for queue in self._queues:
      queue.clear()

  def _cancel(self) -> None:
    token = self._skip_token
    if token is not None:
      token.cancel()
    self._stop_fetcher()

  def _fetch(self, shard: int, step: int, position: str, token: CancelToken) -> None:
    """A fetch thread: sub-stream `shard`'s chunks (the stream's, for one),
    each from where the last ended."""
    per_request = self._window.steps_per_request
    ahead = self._ahead
    queue = self._queues[shard]
    put = lambda item: self._put(queue, item)
    try:
      while True:
        n = per_request - step % per_request  # chunks end at multiples of their size
        with self._cond:
          while not self._stopped and len(queue) + n > ahead and queue:
            self._cond.wait()
          if self._stopped:
            return
        out = Arrivals(put)
        request = self._request(step, n, stream_state=position, stream_shard=shard)
        try:
          self._backend.fetch(request, token, out)
        except EndOfDataError:
          put(_END)
          return
        step += len(out)
        position = out[-1].next_stream_state
    except BaseException as e:  # pylint: disable=broad-except
      if not token.cancelled:  # a Cancelled we did not ask for is an error too
        put(e)

  def _put(self, queue: collections.deque[Any], item: Any) -> None:
    with self._cond:
      if not self._stopped:
        queue.append(item)
        self._cond.notify_all()

  # -- the iterator ---------------------------------------------------------

  def __next__(self) -> Any:
    called_at = time.monotonic()
    with self._cond:
      self._check_open()
    if not self._fetchers:
      if self._ended():
        raise StopIteration
      self._start()
    with self._cond:
      while True:
        heads = [q[0] if q else None for q in self._queues]
        for item in heads:
          if isinstance(item, BaseException):
            raise item
        if self._ended():
          raise StopIteration
        if all(item is not None for item in heads):
          break
        if not all(f.is_alive() for f, q in zip(self._fetchers, self._queues) if not q):
          # each puts before it ends, under this lock
          raise ElevatorError(f"{self._spec}: a fetch thread ended with nothing to deliver")
        self._cond.wait(1.0)
      items = [None if q[0] is _END else q.popleft() for q in self._queues]
      self._cond.notify_all()  # room for the next chunk
    self._step += 1
    for j, item in enumerate(items):
      if item is not None:
        self._positions[j] = item.next_stream_state
    return self._delivered(called_at, self._assembled(items))

  def _ended(self) -> bool:
    """Whether the stream has ended (hold _cond, or no fetch thread runs):
    in training mode once a sub-stream has, in evaluation mode once all have."""
    ended = [bool(q) and q[0] is _END for q in self._queues]
    return all(ended) or (self._info.drop_remainder and any(ended))

  def _assembled(self, items: list[Any]) -> list[Any]:
    """This host's rows of one step: each sub-stream's, one after another
    (zero rows, masked out, from one that ended: evaluation mode)."""
    if self._shards == 1:
      return items[0].leaves
    parts = [(item, rows) for item, rows in zip(items, self._rows) if len(rows)]
    if len(parts) == 1 and parts[0][0] is not None:
      return parts[0][0].leaves
    leaves = []
    for i, spec in enumerate(self._info.element_spec.leaves):
      pieces = [item.leaves[i] if item is not None
                else np.zeros((len(rows), *spec.shape), spec.dtype) for item, rows in parts]
      leaves.append(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
    return leaves

  # -- skipping -------------------------------------------------------------

  def skip(self, num_steps: int) -> None:
    """Drops the next `num_steps` global batches (rollback-and-skip): the
    servers move each sub-stream's position past them without sending any
    (one Skip call per SKIP_ROWS_PER_CALL rows), and the cursor records the
    range. InvalidRequestError for a count below 0, or one past the end of
    a finite stream (the iterator then stays where it was)."""
    self._check_open()
    contract.check_skip(self._step, num_steps, self._spec.global_batch_size,
                        dataset=self._spec.dataset)
    skips = state_lib.add_skip(self._skips, self._step, num_steps)
    self._stop()
    positions = self._fast_forward(self._step, self._positions, num_steps)
    self._step, self._positions, self._skips = self._step + num_steps, positions, skips

  def _fast_forward(self, step: int, positions: list[str], num_steps: int) -> list[str]:
    """Each sub-stream's position `num_steps` steps after `positions` (at
    `step`), found at once."""
    token = self._skip_token = CancelToken()
    try:
      return fast_forward(self._backend, self._spec, step, positions, num_steps, token)
    finally:
      self._skip_token = None

  # -- checkpointing --------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return self._state(state_lib.Cursor(self._step, skips=self._skips,
                                        positions=tuple(self._positions)))

  def set_state(self, state: dict[str, Any]) -> None:
    cursor = self._cursor(state)
    self._stop()
    step = cursor.step
    positions = [p or start for p, start in zip(cursor.positions, self._info.starts)]
    if cursor.pending is not None:  # a skip written into the state: make it now
      positions = self._fast_forward(step, positions, cursor.pending - step)
      step = cursor.pending
    self._step, self._positions, self._skips = step, positions, cursor.skips


def fast_forward(backend: Backend, spec: ReadSpec, step: int, positions: Sequence[str],
                 num_steps: int, token: CancelToken) -> list[str]:
  """Each sub-stream's position (one for a stream of one) `num_steps`
  global batches after `positions` (where `step` starts), found by the
  servers without sending any batch, all sub-streams at once: one Skip call
  per SKIP_ROWS_PER_CALL rows. InvalidRequestError if the stream ends
  first: in evaluation mode, once every sub-stream has ended (one that has
  stays at its end, giving padding rows); else once any has."""
  n = len(positions)
  if n == 1:
    forwarded = [_forward(backend, spec, step, positions[0], num_steps, token, 0)]
  else:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
      forwarded = list(pool.map(lambda j: _forward(backend, spec, step, positions[j],
                                                   num_steps, token, j), range(n)))
  ended = [why for _, why in forwarded if why is not None]
  if ended and (len(ended) == n or spec.require_info().drop_remainder):
    raise InvalidRequestError(
        f"{spec}: a skip of {num_steps} steps from step {step} passes the end of the "
        f"stream ({ended[0]}); the iterator stays at step {step}")
  return [position for position, _ in forwarded]


def _forward(backend: Backend, spec: ReadSpec, step: int, position: str, num_steps: int,
             token: CancelToken, shard: int) -> tuple[str, str | None]:
  """Sub-stream `shard`'s position `num_steps` steps on, and why not, if
  it ended first in evaluation mode (its end position then); the stream's
  end otherwise is InvalidRequestError."""
  per_call = limits.skip_steps(spec.global_batch_size // len(spec.require_info().starts))
  end = step + num_steps
  while step < end:
    n = min(per_call, end - step)
    try:
      answer = backend.skip(spec.request(step, n, stream_state=position,
                                         stream_shard=shard), token)
    except EndOfDataError as e:  # the stream's end (a sub-stream's says stream_ended)
      raise InvalidRequestError(
          f"{spec}: a skip of {num_steps} steps from step {end - num_steps} passes the end "
          f"of the stream ({e}); the iterator stays at step {end - num_steps}") from None
    position = answer.next_stream_state
    if answer.stream_ended:
      return position, f"sub-stream {shard} ends before step {end}"
    step += n
  return position, None
