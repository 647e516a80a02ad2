"""`RemoteDataset`: a `grain.IterDataset` of global-batch slices from the service.

Step k of host h of H is rows [h*G/H, (h+1)*G/H) of global batch k (the
contract, proto/contract.py). The iterator keeps up to `prefetch` steps in
flight over several connections and replicas (client/transport/pool.py),
delivers them in step order, and its state is a global cursor that resumes
in O(1) on any number of hosts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
import weakref
from typing import Any, Sequence

import grain

from grain_elevator.client import closing, layout, state as state_lib
from grain_elevator.client import stats as stats_lib
from grain_elevator.client import window as window_lib
from grain_elevator.client.backend import Backend, make_backend
from grain_elevator.client.options import RetryPolicy, Security, TransportOptions
from grain_elevator.client.transport import targets as targets_lib
from grain_elevator.client.transport.host_memory import HostMemory
from grain_elevator.client.transport.connection import CancelToken, Step
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto import wire
from grain_elevator.proto.errors import (Cancelled, ElevatorError, InvalidRequestError,
                                         UnknownDatasetError)
from grain_elevator.proto.spec import DatasetInfo

# What the TypeError for an option given as something else suggests.
_EXAMPLES = {"transport": "TransportOptions(kind='grpc')",
             "retry": "RetryPolicy(timeout_s=300)",
             "security": "Security(auth_token='...')"}


def describe(target: str | Sequence[str], dataset: str | None = None, *,
             retry: RetryPolicy = RetryPolicy(),
             security: Security = Security()) -> list[DatasetInfo]:
  """What a server (or a local config) offers."""
  backend = make_backend(target, transport=TransportOptions(connections_per_target=1),
                         retry=retry, security=security)
  try:
    return backend.describe(dataset or "")
  finally:
    backend.close()


class _Arrivals(list):
  """A request's steps, appended by the fetch thread as they arrive; wakes
  the trainer's thread, which may take each one before the request ends."""

  def __init__(self, arrived: threading.Condition):
    super().__init__()
    self._arrived = arrived

  def append(self, item: Any) -> None:
    with self._arrived:
      super().append(item)
      self._arrived.notify_all()


@dataclasses.dataclass(frozen=True)
class _Chunk:
  start: int
  num_steps: int
  steps: _Arrivals
  future: concurrent.futures.Future
  token: CancelToken


class RemoteDataset(grain.IterDataset):
  """Host `shard_index`'s slices of a served dataset's global batches.

  Example:
    ds = RemoteDataset("localhost:50051", "train", global_batch_size=256,
                       shard_index=jax.process_index(),
                       shard_count=jax.process_count())
    for batch in ds: ...  # dict of numpy arrays, G/H rows each

  Args:
    target: "host:port", a list of replicas, a gRPC URI such as
      "dns:///name:port" (a headless Service: every address behind it), or
      "local:CONFIG_PATH" to run the same pipeline in-process (embedded mode,
      bit-identical).
    dataset: a dataset name registered in the server's config.
    global_batch_size: G, the batch size summed over all hosts.
    shard_index: h, this host's index in [0, shard_count). Default:
      `jax.process_index()` when JAX runs as several processes, else the
      rank in torch.distributed's default group when it is initialized with
      several ranks, else 0 (client/layout.py).
    shard_count: H, the number of hosts; must divide G. Default: the
      matching `jax.process_count()` or world size, else 1.
    prefetch: steps kept in flight ahead of the trainer (0: fetch on demand),
      fixed; None (the default): one request per connection carrying batches
      (by default window.REQUESTS_PER_WORKER per server worker), then
      adapted while the trainer runs: more while it waits for data, fewer
      while steps pile up (client/window.py). `stats().window` says where it
      stands.
    window_bytes: the most a default window holds, received or coming
      (None: window.WINDOW_BYTES); bounds the adaptive window's memory.
    transport: how batches travel (TransportOptions: bulk or gRPC,
      connections per replica, steps per request, compression).
    retry: when to try again and when to give up (RetryPolicy).
    security: TLS and the bearer token (Security).
    stats_log_s: log each iterator's `Stats` line (time waited for data,
      throughput, retries, fallbacks) at INFO every this many seconds; 0: never.

  Attributes:
    host_memory: where iterators started from now on receive batches over
      the bulk transport (client/transport/host_memory.py): None, ordinary
      memory; `to_device` with a GPU sharding and `TorchLoader(device="cuda")`
      set page-locked memory here unless it was set already.

  Raises:
    InvalidRequestError: bad geometry (G < 1, G % H != 0, h out of range),
      targets or options (a ValueError too).
    TypeError: an options argument of the wrong class.
  """

  def __init__(self, target: str | Sequence[str], dataset: str,
               global_batch_size: int, *, shard_index: int | None = None,
               shard_count: int | None = None, prefetch: int | None = None,
               window_bytes: int | None = None, transport: TransportOptions = TransportOptions(),
               retry: RetryPolicy = RetryPolicy(), security: Security = Security(),
               stats_log_s: float = 60.0):
    super().__init__()
    if shard_index is None and shard_count is None:
      shard_index, shard_count = layout.process_layout() or (0, 1)
    elif shard_index is None or shard_count is None:
      raise InvalidRequestError("give both shard_index and shard_count, or neither")
    contract.check_geometry(global_batch_size, shard_index, shard_count)
    if prefetch is not None and prefetch < 0:
      raise InvalidRequestError(f"need prefetch >= 0, got {prefetch}")
    if window_bytes is not None and window_bytes < 1:
      raise InvalidRequestError(f"need window_bytes >= 1, got {window_bytes}")
    for name, value, cls in (("transport", transport, TransportOptions),
                             ("retry", retry, RetryPolicy), ("security", security, Security)):
      if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, e.g. {name}={_EXAMPLES[name]}; "
                        f"got {type(value).__name__} {value!r}")
    transport.check_security(security)
    self.targets = targets_lib.parse_targets(target)
    self.dataset = dataset
    self.global_batch_size = global_batch_size
    self.shard_index = shard_index
    self.shard_count = shard_count
    self.prefetch = prefetch
    self.window_bytes = window_lib.WINDOW_BYTES if window_bytes is None else window_bytes
    self.transport = transport
    self.retry = retry
    self.security = security
    self.stats_log_s = stats_log_s
    self.host_memory: HostMemory | None = None
    self._iterators: weakref.WeakSet[_RemoteIterator] = weakref.WeakSet()
    self._embedded: Backend | None = None
    self._embedded_lock = threading.Lock()

  def _new_backend(self) -> Backend:
    """Connections of one iterator; embedded mode shares one opened dataset."""
    if targets_lib.local_config(self.targets) is not None:
      with self._embedded_lock:
        if self._embedded is None:
          self._embedded = make_backend(self.targets)
        return self._embedded
    return make_backend(self.targets, transport=self.transport, retry=self.retry,
                        security=self.security, host_memory=self.host_memory,
                        window_bytes=self.window_bytes)

  @classmethod
  def embedded(cls, config_path: str, dataset: str, global_batch_size: int,
               **kwargs: Any) -> "RemoteDataset":
    """Embedded mode: the same stream computed in-process from a config."""
    return cls(targets_lib.local_target(str(config_path)), dataset, global_batch_size, **kwargs)

  def __iter__(self) -> grain.DatasetIterator:
    backend = self._new_backend()
    try:
      (info,) = backend.describe(self.dataset, self.global_batch_size)
      if info.name != self.dataset:
        raise UnknownDatasetError(f"server answered for {info.name!r}, not {self.dataset!r}")
    except BaseException:
      backend.close()
      raise
    if info.stream:  # sequential, from a stream position (client/stream_iterator.py)
      from grain_elevator.client.stream_iterator import StreamIterator  # pylint: disable=g-import-not-at-top
      it: Any = StreamIterator(self, backend, info)
    else:
      it = _RemoteIterator(self, backend, info)
    self._iterators.add(it)
    return it

  def explain(self, step: int, *, record_offset: int = 0,
              stream_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """What global batch `step` held: for each row of this host's slice, the
    record position, epoch, source record, shard and record index in it (a
    mixture: also the component), or that it is evaluation padding. The
    JSON-safe dict of docs/client.md ("What a step held"). `step` is the
    data's step (a cursor's; after skips, `state.trained_steps` maps back).
    A stream dataset's rows list their packed segments, traced from the
    position where `step` starts: `stream_state` (a cursor's, saved at
    `step`), or found from the stream's start by the servers (O(step)).

    Raises:
      InvalidRequestError: a negative step, or one whose records lie past int64.
      EndOfDataError: a step past the end of a finite dataset.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise InvalidRequestError(f"explain needs a step >= 0, got {step!r}")
    if record_offset + (step + 1) * self.global_batch_size > contract.MAX_RECORD_POSITION:
      raise InvalidRequestError(
          f"step {step} of global batch size {self.global_batch_size} lies past the "
          "wire's largest record position (2**63 - 1)")
    backend = make_backend(self.targets, transport=TransportOptions(connections_per_target=1),
                           retry=self.retry, security=self.security)
    try:
      (info,) = backend.describe(self.dataset)
      position = ""
      if info.stream:
        from grain_elevator.client import stream_iterator  # pylint: disable=g-import-not-at-top
        if stream_state is not None:
          position = contract.position_text(stream_state)
        elif step:
          position = stream_iterator.fast_forward(backend, self, info, 0, "", step,
                                                  CancelToken())
      return backend.explain(pb.ExplainRequest(request=pb.BatchRequest(
          dataset=self.dataset, global_batch_size=self.global_batch_size,
          shard_index=self.shard_index, shard_count=self.shard_count, start_step=step,
          num_steps=1, record_offset=record_offset, stream_state=position,
          config_fingerprint=info.config_fingerprint)))
    finally:
      backend.close()

  def summary(self, start: int, end: int, *, record_offset: int = 0) -> dict[str, Any]:
    """Records per mixture component (or of the dataset) in the whole global
    batches [start, end), computed from the contract, not logged: the JSON
    of docs/client.md ("Counts over a range of steps")."""
    for name, value in (("start", start), ("end", end)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequestError(f"summary needs a {name} step >= 0, got {value!r}")
    if end <= start:
      raise InvalidRequestError(f"summary needs start < end, got {start}:{end}")
    if record_offset + end * self.global_batch_size > contract.MAX_RECORD_POSITION:
      raise InvalidRequestError(
          f"step {end} of global batch size {self.global_batch_size} lies past the wire's "
          "largest record position (2**63 - 1)")
    backend = make_backend(self.targets, transport=TransportOptions(connections_per_target=1),
                           retry=self.retry, security=self.security)
    try:
      (info,) = backend.describe(self.dataset)
      return backend.explain(pb.ExplainRequest(summary=True, request=pb.BatchRequest(
          dataset=self.dataset, global_batch_size=self.global_batch_size, shard_count=1,
          start_step=start, num_steps=end - start, record_offset=record_offset,
          config_fingerprint=info.config_fingerprint)))
    finally:
      backend.close()

  def stats(self) -> stats_lib.Stats:
    """Whether the trainer waits on data: `Stats` summed over this dataset's
    live iterators (client/stats.py)."""
    return sum((it.stats() for it in list(self._iterators)), stats_lib.Stats())

  def close(self) -> None:
    """Cancels every iterator's in-flight requests and closes its connections."""
    for it in list(self._iterators):
      it.close()

  def __enter__(self) -> "RemoteDataset":
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __str__(self) -> str:
    return (f"RemoteDataset(targets={self.targets}, dataset={self.dataset!r}, "
            f"G={self.global_batch_size}, h={self.shard_index}/{self.shard_count})")


class _RemoteIterator(grain.DatasetIterator):
  """Delivers steps in order while keeping `prefetch` of them in flight."""

  def __init__(self, ds: RemoteDataset, backend: Backend, info: DatasetInfo):
    super().__init__()
    self._ds = ds
    self._backend = backend
    self._closed = True  # until constructed: __del__ closes only a whole iterator
    self._info = info
    self._offset = 0  # records before step 0: nonzero once G changed at a checkpoint
    self._total = self._info.total_steps(ds.global_batch_size)
    self._window = window_lib.for_dataset(ds, info, backend.parallelism)
    # None: a window the user fixed (prefetch given)
    self._tune = window_lib.Autotune(self._window) if self._window.adaptive else None
    self._structure = self._info.element_spec.structure
    self._step = 0  # next step the trainer receives
    self._skips: state_lib.Skips = ()  # steps skipped ([a, b) ranges), for the cursor
    self._requested = 0  # first step not yet requested
    self._chunks: collections.deque[_Chunk] = collections.deque()
    self._lock = threading.Lock()
    self._arrived = threading.Condition()  # a step arrived or a fetch ended
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    tune, window = self._tune, self._window  # not self: the meter must not keep it alive
    self._meter = stats_lib.meter_for(
        ds, backend, (lambda: tune.prefetch) if tune is not None else (lambda: window.prefetch))
    self._closed = False
    closing.start()  # where a dropped iterator gets closed

  def stats(self) -> stats_lib.Stats:
    """Time waited for data, throughput, retries, fallbacks, the window."""
    return self._meter.stats()

  @property
  def _prefetch(self) -> int:
    """Steps to keep in flight now."""
    return self._tune.prefetch if self._tune is not None else self._window.prefetch

  # -- fetching -------------------------------------------------------------

  def _request(self, start: int, num_steps: int) -> pb.BatchRequest:
    ds = self._ds
    return pb.BatchRequest(
        dataset=ds.dataset, global_batch_size=ds.global_batch_size,
        shard_index=ds.shard_index, shard_count=ds.shard_count,
        start_step=start, num_steps=num_steps, record_offset=self._offset,
        config_fingerprint=self._info.config_fingerprint,
        compression=wire.COMPRESSIONS[ds.transport.compression])

  def _fill(self) -> None:
    """Requests steps until `prefetch` (at least 1) are in flight."""
    prefetch, per_request = self._prefetch, self._window.steps_per_request
    limit = self._step + max(1, prefetch)
    if self._total is not None:
      limit = min(limit, self._total)
    if self._requested < limit and self._pool is None:
      workers = max(1, -(-max(prefetch, self._window.most) // per_request))
      self._pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=workers, thread_name_prefix="grain-elevator-fetch")
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
      steps = _Arrivals(self._arrived)
      future = self._pool.submit(self._backend.fetch,
                                 self._request(self._requested, n), token, steps)
      future.add_done_callback(self._wake)
      self._chunks.append(_Chunk(self._requested, n, steps, future, token))
      self._requested += n

  def _wake(self, _: concurrent.futures.Future) -> None:
    with self._arrived:
      self._arrived.notify_all()

  def _take(self, chunk: _Chunk, i: int) -> list[Any]:
    """Step `i` of `chunk` once it has arrived; the fetch's error if it failed first."""
    with self._arrived:
      while len(chunk.steps) <= i and not chunk.future.done():
        self._arrived.wait()
    if len(chunk.steps) > i:
      taken = chunk.steps[i]
      # The trainer's now, not the window's; the position stays (a retry continues from it).
      chunk.steps[i] = Step([], taken.next_stream_state)
      return taken.leaves
    chunk.future.result()  # raises what ended the fetch
    raise ElevatorError(f"{self._ds}: step {chunk.start + i} was not received")

  def _cancel_all(self) -> None:
    while self._chunks:
      chunk = self._chunks.popleft()
      chunk.token.cancel()
      chunk.future.cancel()
    self._requested = self._step

  def __next__(self) -> Any:
    called_at = time.monotonic()
    with self._lock:
      if self._closed:
        raise ElevatorError(f"{self._ds} iterator is closed")
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
        leaves = self._take(chunk, i)
      except Cancelled:
        raise Cancelled(f"{self._ds} iterator was closed") from None
      if self._step == chunk.start + chunk.num_steps - 1:
        self._chunks.popleft()
      self._step += 1
      if self._tune is not None:
        self._tune.observe(waited, ready)
      if self._window.prefetch:
        self._fill()  # keep the window full while the trainer works
    # The whole call counts as waiting for data: the trainer did nothing else.
    self._meter.delivered(called_at, time.monotonic(),
                          sum(getattr(x, "nbytes", 0) for x in leaves))
    return tree.unflatten(self._structure, leaves)

  def skip(self, num_steps: int) -> None:
    """Drops the next `num_steps` global batches (rollback-and-skip), in
    O(1): the cursor records the range, so every host and every later
    checkpoint continues the same stream. InvalidRequestError for a count
    below 0, or one past the end of a finite dataset."""
    with self._lock:
      if self._closed:
        raise ElevatorError(f"{self._ds} iterator is closed")
      g = self._ds.global_batch_size
      contract.check_skip(self._step, num_steps, g, self._offset, self._total,
                          self._ds.dataset)
      skips = state_lib.add_skip(self._skips, self._step, num_steps)
      self._cancel_all()
      if self._tune is not None:
        self._tune.restart()
      self._skips = skips
      self._step = self._requested = self._step + num_steps

  # -- checkpointing --------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return state_lib.make(state_lib.Cursor(self._step, self._offset, skips=self._skips),
                          self._info, self._ds.global_batch_size)

  def set_state(self, state: dict[str, Any]) -> None:
    cursor = state_lib.check(state, self._info, self._ds.global_batch_size)
    with self._lock:
      self._cancel_all()
      if self._tune is not None:
        self._tune.restart()
      self._step = self._requested = cursor.step
      self._skips = cursor.skips
      self._offset = cursor.record_offset
      self._total = self._info.total_steps(self._ds.global_batch_size, self._offset)

  # -- lifecycle ------------------------------------------------------------

  def _stop_pool(self) -> None:
    # getattr: an iterator whose construction failed part-way is closed too.
    pool, self._pool = getattr(self, "_pool", None), None
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    # Cancel first, without the lock: a __next__ blocked on a fetch holds it.
    for chunk in list(self._chunks):
      chunk.token.cancel()
    with self._lock:
      self._cancel_all()
      self._backend.close()
      self._stop_pool()

  # `later` bound now: at interpreter exit this module's globals may already
  # be None when a finalizer runs.
  def __del__(self, _later=closing.later) -> None:
    if not getattr(self, "_closed", True):  # closed by the closing thread (client/closing.py)
      _later(self.close)

  def __str__(self) -> str:
    return f"{self._ds} @ step {self._step}"
