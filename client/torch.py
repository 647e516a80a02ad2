"""PyTorch trainers: a `RemoteDataset`'s batches as torch tensors.

    ds = RemoteDataset("elevator:50051", "train", global_batch_size=256)
    loader = TorchLoader(ds)                 # ranks from torch.distributed
    for batch in loader: ...                 # dict of torch.Tensor, G/H rows
    dcp.save({"model": model, "data": loader}, checkpoint_id=path)

`TorchLoader` follows torch's `Stateful` protocol: `state_dict()` is the same
global cursor as `RemoteDataset`'s Grain state (client/state.py), one value
for every rank, so a job saved on 4 ranks resumes on 2 or 8 at the same
step. It is an `IterableDataset` too, so torchdata's `StatefulDataLoader`
(`batch_size=None, num_workers=0`) can wrap it and saves its state inside
its own.

No copy on the way: a leaf becomes a tensor with `torch.from_numpy` over the
bytes as received. Those bytes sit in the client's receive buffers
(client/transport/buffers.py), which are lent out again only once nothing
refers to them; a tensor made by `from_numpy` holds a reference to the
array it views, so a buffer under a live tensor is never reused, and a
tensor never changes under the trainer. Leaves that torch has no dtype for
(fixed-width bytes) stay numpy arrays. With `device="cuda"` those buffers
are torch's pinned memory, so the copy to the GPU is one asynchronous DMA
from where the bytes landed.

Needs the `torch` extra (`pip install 'grain-elevator[torch]'`).
"""

from __future__ import annotations

import collections
import json
import warnings
from typing import Any, Iterator

import grain
import numpy as np

try:
  import torch
  from torch.utils.data import IterableDataset, get_worker_info
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError("grain_elevator.client.torch needs PyTorch: "
                    "pip install 'grain-elevator[torch]'") from e

from grain_elevator.client import device as device_lib
from grain_elevator.client import layout
from grain_elevator.client import state as state_lib
from grain_elevator.client.transport import host_memory
from grain_elevator.proto.errors import InvalidRequestError

# The key of `TorchLoader.state_dict()`: one JSON text, so that
# torch.distributed.checkpoint stores it as one object, not a tree of
# scalars it has to flatten.
STATE_KEY = "grain_elevator_state"


def data_parallel_shard(mesh: Any = None, mesh_dim: int | str | None = None
                        ) -> tuple[int, int]:
  """(shard_index, shard_count) for this rank: its coordinate along the
  data-parallel dimension `mesh_dim` of a `DeviceMesh`, or, with no mesh,
  its rank and world size in torch.distributed's default group ((0, 1) when
  that is not initialized).

  Ranks that differ only along other dimensions (tensor or pipeline
  parallel) get the same shard: the same rows, as they must.
  """
  if mesh is None:
    return layout.torch_process_layout() or (0, 1)
  dim = _mesh_dim(mesh, mesh_dim)
  return mesh.get_local_rank(dim), mesh.size(dim)


def _mesh_dim(mesh: Any, mesh_dim: int | str | None) -> int | str:
  if mesh_dim is not None:
    return mesh_dim
  if mesh.ndim != 1:
    names = getattr(mesh, "mesh_dim_names", None)
    raise InvalidRequestError(
        f"a {mesh.ndim}-dimensional DeviceMesh (dims {names}) needs mesh_dim: the "
        "dimension that splits the batch (data parallel)")
  return 0


# --- numpy -> torch, without copying -----------------------------------------

def _tensor(leaf: Any) -> Any:
  """A tensor over `leaf`'s memory; `leaf` itself where torch has no dtype."""
  if not isinstance(leaf, np.ndarray):
    return leaf
  if leaf.dtype.name == "bfloat16":  # ml_dtypes' (its kind is "V"): same bits, reinterpreted
    return _from_numpy(leaf.view(np.uint16)).view(torch.bfloat16)
  if leaf.dtype.kind in "SUVO":
    return leaf  # bytes and strings: torch has no tensor of them
  return _from_numpy(leaf)


def _from_numpy(leaf: np.ndarray) -> Any:
  if leaf.flags.writeable:
    return torch.from_numpy(leaf)
  # The gRPC transport's leaves view the received message's bytes, which
  # this batch alone refers to; torch warns because it cannot mark a tensor
  # read-only. Writing into it changes only this batch, as with bulk buffers.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    return torch.from_numpy(leaf)


def to_tensors(batch: Any) -> Any:
  """A host batch (pytree of numpy arrays) as torch tensors sharing its memory."""
  return _map(_tensor, batch)


def _map(fn: Any, tree: Any) -> Any:
  """`fn` over the leaves of a batch (dicts, lists, tuples), structure kept."""
  if isinstance(tree, dict):
    return {k: _map(fn, v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_map(fn, v) for v in tree)
  return fn(tree)


# --- onto a device -----------------------------------------------------------

class _ToDevice:
  """Host tensors -> `device`, issued from the read-ahead thread on a stream
  of its own so the copies overlap the training step.

  A tensor in page-locked memory (where the client received it,
  client/transport/host_memory.py) is copied asynchronously as it lies;
  another is first copied into page-locked memory with `pin_memory`, else
  copied synchronously. The host batch of a copy still in flight is held
  until its event has passed: its receive buffer is lent again only once
  nothing refers to it, and must not be while the DMA reads it."""

  def __init__(self, device: torch.device, pin_memory: bool):
    self._device = device
    self._pin = pin_memory
    self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    # (copy's event, its host batch), oldest first: as many as copies in flight.
    self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()

  def __call__(self, batch: Any) -> Any:
    while self._in_flight and self._in_flight[0][0].query():
      self._in_flight.popleft()

    def move(t: Any) -> Any:
      if not isinstance(t, torch.Tensor):
        return t
      pinned = self._stream is not None and t.is_pinned()
      if not pinned and self._pin:
        t, pinned = t.pin_memory(), True  # a copy, into page-locked memory
      return t.to(self._device, non_blocking=pinned)

    if self._stream is None:
      return _map(move, batch), None
    with torch.cuda.stream(self._stream):
      moved = _map(move, batch)
      done = self._stream.record_event()
    self._in_flight.append((done, batch))
    return moved, done


def _ready(item: tuple[Any, Any]) -> Any:
  """On the trainer's thread: its stream waits for the copy, and the memory
  is marked in use by that stream (the caching allocator then keeps it)."""
  batch, done = item
  if done is not None:
    current = torch.cuda.current_stream()
    current.wait_event(done)
    _map(lambda t: t.record_stream(current) if isinstance(t, torch.Tensor) else t, batch)
  return batch


def _as_dtensor(mesh: Any, mesh_dim: int | str) -> Any:
  from torch.distributed.tensor import DTensor, Replicate, Shard  # pylint: disable=g-import-not-at-top
  names = mesh.mesh_dim_names or ()
  index = names.index(mesh_dim) if isinstance(mesh_dim, str) else mesh_dim
  placements = [Shard(0) if i == index else Replicate() for i in range(mesh.ndim)]
  ways = mesh.size(index)

  def put(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
      return t
    if t.device.type != mesh.device_type:
      t = t.to(mesh.device_type)
    shape = torch.Size((t.shape[0] * ways,) + tuple(t.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()  # contiguous, computed without memory
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

  return lambda batch: _map(put, batch)


def to_dtensor(batch: Any, mesh: Any, mesh_dim: int | str | None = None) -> Any:
  """This rank's rows as `DTensor`s of the global batch, sharded on the batch
  dimension along `mesh_dim` and replicated along the others.

  Every rank must hold the rows of its coordinate along `mesh_dim`
  (`data_parallel_shard(mesh, mesh_dim)`); `TorchLoader(mesh=...)` checks it.
  """
  return _as_dtensor(mesh, _mesh_dim(mesh, mesh_dim))(batch)


# --- the loader --------------------------------------------------------------

class TorchLoader(IterableDataset):
  """Batches of a `RemoteDataset` (or any Grain `IterDataset` of numpy
  pytrees) as torch tensors, checkpointable with torch.distributed.checkpoint.

  Args:
    dataset: the host's batches; a `RemoteDataset` reads rank h of H, by
      default from torch.distributed (`data_parallel_shard`).
    device: where batches go ("cuda", "cuda:1", a torch.device); None keeps
      them on the host as views of the received bytes. For a CUDA device a
      `RemoteDataset` receives into torch's pinned (page-locked) memory, so
      each copy to the device is one asynchronous DMA.
    pin_memory: copy into page-locked memory first each tensor that is not
      there already (a gRPC batch, one of another dataset), so its copy is
      asynchronous too (`non_blocking=True`). Ignored, with a warning,
      where no CUDA device is present.
    device_buffer: batches copied to `device` ahead of the trainer.
    mesh: yield `DTensor`s on this `DeviceMesh`, the batch sharded along
      `mesh_dim`; the dataset's shard must be this rank's coordinate along it.
    mesh_dim: the mesh's data-parallel dimension (name or index); may be left
      out for a 1-dimensional mesh.

  `iter(loader)` starts at step 0, or where `load_state_dict` put it;
  `state_dict()` is the position after the last batch the trainer received.
  Use it in the trainer's process (`num_workers=0` under a DataLoader): the
  service already runs the pipeline's work elsewhere.
  """

  def __init__(self, dataset: grain.IterDataset, *, device: Any = None,
               pin_memory: bool = False, device_buffer: int = 2, mesh: Any = None,
               mesh_dim: int | str | None = None):
    super().__init__()
    self.dataset = dataset
    self.device = torch.device(device) if device is not None else None
    if pin_memory and not torch.cuda.is_available():
      warnings.warn("TorchLoader: pin_memory=True, but no CUDA device is present; "
                    "batches stay in ordinary memory", stacklevel=2)
      pin_memory = False
    self.pin_memory = pin_memory
    if self.device is not None and self.device.type == "cuda":
      device_lib.receive_page_locked(dataset, host_memory.torch_pinned_memory())
    if mesh is not None:
      mesh_dim = _mesh_dim(mesh, mesh_dim)
      _check_shard(dataset, mesh, mesh_dim)
    self._pipeline = self._build(device_buffer, mesh, mesh_dim)
    self._iterator: grain.DatasetIterator | None = None
    self._fresh = False  # _iterator has delivered nothing yet
    self._pending: dict[str, Any] | None = None

  def _build(self, device_buffer: int, mesh: Any, mesh_dim: Any) -> grain.IterDataset:
    ds = self.dataset.map(to_tensors)
    if self.device is not None and (self.device.type != "cpu" or self.pin_memory):
      ds = device_lib.buffered_put(ds, _ToDevice(self.device, self.pin_memory),
                                   cpu_buffer=2, device_buffer=device_buffer).map(_ready)
    if mesh is not None:
      ds = ds.map(_as_dtensor(mesh, mesh_dim))
    return ds

  def _new_iterator(self) -> grain.DatasetIterator:
    info = get_worker_info()
    if info is not None and info.num_workers > 1:
      raise InvalidRequestError(
          f"TorchLoader runs in DataLoader worker {info.id} of {info.num_workers}: each "
          "worker would read the same rows. Use num_workers=0 (the service does the "
          "data work) and batch_size=None")
    return iter(self._pipeline)

  def __iter__(self) -> Iterator[Any]:
    if self._iterator is None or not self._fresh:
      self._iterator = self._new_iterator()
    if self._pending is not None:
      self._iterator.set_state(self._pending)
      self._pending = None
    self._fresh = False
    return self._iterator

  # -- torch's Stateful protocol ---------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """{STATE_KEY: the cursor as JSON}: the same on every rank."""
    if self._pending is not None:
      state = self._pending
    else:
      if self._iterator is None:
        self._iterator, self._fresh = self._new_iterator(), True
      state = self._iterator.get_state()
    return {STATE_KEY: json.dumps(state, sort_keys=True)}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Continues from a `state_dict()` of this stream, saved on any number of
    ranks; the next `iter(loader)` starts there. A state of another stream
    is refused when the iterator starts (StreamMismatchError)."""
    if not isinstance(state_dict, dict) or STATE_KEY not in state_dict:
      keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
      raise InvalidRequestError(
          f"not a TorchLoader state: expected a dict with {STATE_KEY!r}, got {keys}")
    text = state_dict[STATE_KEY]
    if not isinstance(text, str):
      raise InvalidRequestError(f"TorchLoader state {STATE_KEY!r} is not JSON text: "
                                f"a {type(text).__name__}")
    state = state_lib.parse(text, f"TorchLoader state {STATE_KEY!r}")  # bounded in size and depth
    it = self._new_iterator()  # checks it now, not at the first batch
    it.set_state(state)
    self._iterator, self._fresh, self._pending = it, True, None

  def stats(self) -> Any:
    """The dataset's `Stats` (time waited for data, throughput, retries)."""
    return self.dataset.stats()

  def __str__(self) -> str:
    return f"TorchLoader({self.dataset}, device={self.device})"


def _check_shard(dataset: Any, mesh: Any, mesh_dim: int | str) -> None:
  want = (mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))
  have = (getattr(dataset, "shard_index", None), getattr(dataset, "shard_count", None))
  if None not in have and have != want:
    raise InvalidRequestError(
        f"{dataset} reads shard {have[0]} of {have[1]}, but this rank is {want[0]} of "
        f"{want[1]} along mesh dimension {mesh_dim!r}; build it with "
        "shard_index, shard_count = data_parallel_shard(mesh, mesh_dim)")


__all__ = ["TorchLoader", "data_parallel_shard", "to_dtensor", "to_tensors", "STATE_KEY"]
