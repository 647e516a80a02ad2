"""`RemoteDataset`: a `grain.IterDataset` of global-batch slices from the service.

Step k of host h of H is rows [h*G/H, (h+1)*G/H) of global batch k (the
contract, proto/contract.py). What a host reads is one `ReadSpec`
(client/read_spec.py), made here from the arguments and described by the
servers. Its iterator is the reader of the dataset's kind on one skeleton
(client/iterator.py): steps asked for in chunks, many in flight
(client/step_iterator.py), or a stream continued from a position
(client/stream_iterator.py); either delivers in step order, and its state is
a global cursor that resumes on any number of hosts.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import grain

from grain_elevator.client import layout
from grain_elevator.client import state as state_lib
from grain_elevator.client import stats as stats_lib
from grain_elevator.client import stream_explain
from grain_elevator.client import stream_summary
from grain_elevator.client.backend import Backend, make_backend
from grain_elevator.client.iterator import ClientIterator, no_parent
from grain_elevator.client.read_spec import Kind, ReadSpec
from grain_elevator.client.step_iterator import StepIterator
from grain_elevator.client.stream_iterator import StreamIterator, fast_forward
from grain_elevator.client.transport import targets as targets_lib
from grain_elevator.client.transport.connection import CancelToken
from grain_elevator.client.transport.host_memory import HostMemory
from grain_elevator.client.transport.options import (WINDOW_BYTES, RetryPolicy, Security,
                                                     TransportOptions)
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import InvalidRequestError, UnknownDatasetError
from grain_elevator.proto.spec import DatasetInfo

# What the TypeError for an option given as something else suggests.
_EXAMPLES = {"transport": "TransportOptions(kind='grpc')",
             "retry": "RetryPolicy(timeout_s=300)",
             "security": "Security(auth_token='...')"}
# The reader of each kind of dataset (client/read_spec.py).
_READERS: dict[Kind, Callable[[ReadSpec, Backend], ClientIterator]] = {
    Kind.STEP: StepIterator, Kind.STREAM: StreamIterator}


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


def _spec_field(name: str) -> property:
  """A RemoteDataset attribute that is its ReadSpec's field `name`, read-only."""
  return property(lambda ds: getattr(ds._spec, name),  # pylint: disable=protected-access
                  doc=f"The dataset's `ReadSpec.{name}` (client/read_spec.py).")


class RemoteDataset(grain.IterDataset):
  """Host `shard_index`'s slices of a served dataset's global batches.

  The arguments, checked (the targets parsed into a list, window_bytes
  resolved), are read-only attributes of the same names (`ds.dataset`,
  `ds.global_batch_size`, ...): together, the dataset's `ReadSpec`
  (client/read_spec.py), which its iterators read.

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
      (by default REQUESTS_PER_WORKER per server worker,
      client/transport/options.py), then
      adapted while the trainer runs: more while it waits for data, fewer
      while steps pile up (client/window.py). `stats().window` says where it
      stands.
    window_bytes: the most a default window holds, received or coming
      (None: WINDOW_BYTES, client/transport/options.py); bounds the
      adaptive window's memory.
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
    self._spec = ReadSpec(
        targets=tuple(targets_lib.parse_targets(target)), dataset=dataset,
        global_batch_size=global_batch_size, shard_index=shard_index,
        shard_count=shard_count, prefetch=prefetch,
        window_bytes=WINDOW_BYTES if window_bytes is None else window_bytes,
        transport=transport, retry=retry, security=security, stats_log_s=stats_log_s)
    self.host_memory: HostMemory | None = None
    self._iterators: weakref.WeakSet[ClientIterator] = weakref.WeakSet()
    self._embedded: Backend | None = None
    self._embedded_lock = threading.Lock()

  _parent = no_parent("RemoteDataset")  # a source: code walking the chain stops here

  @property
  def targets(self) -> list[str]:
    return list(self._spec.targets)

  dataset = _spec_field("dataset")
  global_batch_size = _spec_field("global_batch_size")
  shard_index = _spec_field("shard_index")
  shard_count = _spec_field("shard_count")
  prefetch = _spec_field("prefetch")
  window_bytes = _spec_field("window_bytes")
  transport = _spec_field("transport")
  retry = _spec_field("retry")
  security = _spec_field("security")
  stats_log_s = _spec_field("stats_log_s")

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
      spec = self._spec.described(info)
      # The reader of its kind: any step in O(1), or a stream from a position.
      it = _READERS[spec.kind](spec, backend)
    except BaseException:
      backend.close()
      raise
    self._iterators.add(it)
    return it

  def explain(self, step: int, *, record_offset: int = 0,
              stream_state: dict[str, Any] | list[Any] | None = None) -> dict[str, Any]:
    """What global batch `step` held: for each row of this host's slice, the
    record position, epoch, source record, shard and record index in it (a
    mixture: also the component), or that it is evaluation padding. The
    JSON-safe dict of docs/client.md ("What a step held"). `step` is the
    data's step (a cursor's; after skips, `state.trained_steps` maps back).
    A stream dataset's rows list their packed segments, traced from the
    position where `step` starts: `stream_state` (a cursor's, saved at
    `step`), or found from the stream's start by the servers (O(step)).
    A stream of N sub-streams: `stream_state` is the list of their N
    positions, and each sub-stream this host has rows of is explained from
    its own (client/stream_explain.py), each row naming its `stream_shard`.

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
    backend = self._control_backend()
    try:
      (info,) = backend.describe(self.dataset)
      spec = self._spec.described(info)
      position = ""
      if spec.kind is Kind.STREAM:
        positions = _positions(backend, spec, step, stream_state)
        if info.stream_shards > 1:
          return stream_explain.explain(backend, spec, step, positions)
        (position,) = positions
      return backend.explain(pb.ExplainRequest(request=spec.request(
          step, 1, record_offset=record_offset, stream_state=position)))
    finally:
      backend.close()

  def summary(self, start: int, end: int, *, record_offset: int = 0,
              stream_state: dict[str, Any] | list[Any] | None = None,
              progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Counts per mixture component (or of the dataset) over the whole
    global batches [start, end), computed, not logged: the JSON of
    docs/client.md ("Counts over a range of steps"). Records, from the
    contract, for a 1:1 dataset or mixture (any range, at once); tokens,
    segments and documents for a stream dataset, each step traced from the
    position where `start` begins: `stream_state` (a cursor's, saved at
    `start`), or found from the stream's start by the servers (O(start)),
    in calls of at most MAX_STREAM_SUMMARY_ROWS rows (`progress(steps)`
    after each). A stream of N sub-streams: `stream_state` is the list of
    their N positions, each sub-stream's sub-batches are counted from its
    own, and the counts added up.
    """
    for name, value in (("start", start), ("end", end)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequestError(f"summary needs a {name} step >= 0, got {value!r}")
    if end <= start:
      raise InvalidRequestError(f"summary needs start < end, got {start}:{end}")
    if record_offset + end * self.global_batch_size > contract.MAX_RECORD_POSITION:
      raise InvalidRequestError(
          f"step {end} of global batch size {self.global_batch_size} lies past the wire's "
          "largest record position (2**63 - 1)")
    backend = self._control_backend()
    try:
      (info,) = backend.describe(self.dataset)
      spec = self._spec.described(info)
      if spec.kind is Kind.STREAM:
        positions = _positions(backend, spec, start, stream_state)
        return stream_summary.summarize(backend, spec, start, end, positions, progress)
      return backend.explain(pb.ExplainRequest(summary=True, request=spec.request(
          start, end - start, record_offset=record_offset, whole=True)))
    finally:
      backend.close()

  def _control_backend(self) -> Backend:
    """One connection per replica, for explain and summary (no batches)."""
    return make_backend(self.targets, transport=TransportOptions(connections_per_target=1),
                        retry=self.retry, security=self.security)

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
    return str(self._spec)


def _positions(backend: Backend, spec: ReadSpec, step: int,
               stream_state: dict[str, Any] | list[Any] | None) -> list[str]:
  """Where each sub-stream (the stream, for one) starts step `step`:
  `stream_state`'s positions (a cursor saved there; null: at its start),
  or each fast-forwarded to from its start by the servers, at once."""
  info = spec.require_info()
  contract.check_stream_shards(spec.global_batch_size, info.stream_shards, info.name)
  if stream_state is not None:
    given = state_lib.saved_positions(stream_state, info, "stream_state")
  elif step:
    given = fast_forward(backend, spec, 0, info.starts, step, CancelToken())
  else:
    given = info.starts
  return [p or start for p, start in zip(given, info.starts)]
