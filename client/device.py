"""Feeding the accelerator: host batches become sharded `jax.Array`s.

Two buffers overlap the work with the training step, as
`grain.experimental.device_put` does: a host-side read-ahead (batches already
received), then a device-side buffer (batches already transferred). Both are
Grain `ThreadPrefetchIterDataset`s, so the iterator state that comes out is
that of the last batch the trainer consumed, not of the read-ahead.

With several JAX processes each host holds only its rows (h of H); the global
array is assembled with `jax.make_array_from_process_local_data`, and this
module checks that the sharding puts exactly those rows on this process's
devices, so the global array of step k equals global batch k of the contract.

When the sharding's devices are GPUs, a `RemoteDataset` given to `to_device`
receives its batches into page-locked host memory (cudaHostAlloc through
cuda-python, client/transport/host_memory.py): the copy to the device is
then one DMA from where the bytes landed, not a memcpy into the driver's
staging buffer first. JAX holds each host array until its copy is done
(or copies it during the call), and the receive buffers are lent again
only once nothing refers to them, so a buffer is never reused under a copy.

JAX is an optional extra (`pip install 'grain-elevator[jax]'`): nothing here
imports it until a batch is put on devices.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from grain_elevator.client.layout import jax_process_layout
from grain_elevator.client.transport import host_memory
from grain_elevator.proto import contract
from grain_elevator.proto.errors import InvalidRequestError


def _jax() -> Any:
  """JAX, or an ImportError saying which extra brings it."""
  try:
    import jax  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "feeding devices (grain_elevator.client.to_device) needs JAX: "
        "pip install 'grain-elevator[jax]'") from e
  return jax


def _batch_axis_size(sharding: Any, num_rows: int) -> None:
  """Raises a clear error when the rows do not divide over the batch axis."""
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None or not len(spec) or spec[0] is None:
    return
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  ways = int(np.prod([mesh.shape[a] for a in axes]))
  if num_rows % ways:
    raise InvalidRequestError(
        f"a batch of {num_rows} rows does not divide over mesh axis "
        f"{'x'.join(axes)} of size {ways}; choose a global batch size that is a "
        f"multiple of {ways}")


def _check_process_rows(sharding: Any, global_shape: tuple[int, ...],
                        shard_index: int, shard_count: int) -> None:
  """Raises unless this process's devices hold rows [h*G/H, (h+1)*G/H)."""
  jax = _jax()
  g = global_shape[0]
  want = set(contract.host_rows(g, shard_index, shard_count))
  have: set[int] = set()
  for device, index in sharding.devices_indices_map(global_shape).items():
    if device.process_index == jax.process_index():
      have.update(range(*index[0].indices(g)))
  if have != want:
    span = f"[{min(have)}, {max(have) + 1})" if have else "no rows"
    raise InvalidRequestError(
        f"the sharding places rows {span} of each global batch on process "
        f"{jax.process_index()}, but this client reads shard {shard_index} of "
        f"{shard_count} (rows [{min(want)}, {max(want) + 1})); build the mesh so "
        "that process h's devices hold the h-th block of the batch axis, e.g. "
        "jax.make_mesh, or set shard_index/shard_count to match")


class PutOnMesh:
  """Host pytree -> pytree of global jax.Arrays laid out by `sharding`."""

  def __init__(self, sharding: Any, layout: tuple[int, int] | None):
    self._sharding = sharding
    self._layout = layout  # (h, H) when several processes share the batch
    self._checked: set[tuple[Any, ...]] = set()

  def _shardings(self, batch: Any) -> Any:
    jax = _jax()
    if isinstance(self._sharding, jax.sharding.Sharding):
      return jax.tree.map(lambda _: self._sharding, batch)
    return self._sharding

  def __call__(self, batch: Any) -> Any:
    jax = _jax()
    shardings = self._shardings(batch)
    if self._layout is None:
      for leaf, s in zip(jax.tree.leaves(batch), jax.tree.leaves(shardings)):
        _batch_axis_size(s, np.shape(leaf)[0])
      return jax.device_put(batch, shardings)
    h, n = self._layout

    def put(leaf: np.ndarray, s: Any) -> jax.Array:
      global_shape = (leaf.shape[0] * n,) + leaf.shape[1:]
      key = (id(s), global_shape)
      if key not in self._checked:
        _batch_axis_size(s, global_shape[0])
        _check_process_rows(s, global_shape, h, n)
        self._checked.add(key)
      return jax.make_array_from_process_local_data(s, leaf, global_shape)

    return jax.tree.map(put, batch, shardings)


def to_device(ds: grain.IterDataset, sharding: Any, *, cpu_buffer: int = 4,
              device_buffer: int = 2,
              process_layout: tuple[int, int] | None = None) -> grain.IterDataset:
  """An IterDataset of global `jax.Array`s laid out by `sharding`.

  Example:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    ds = to_device(RemoteDataset(target, "train", G), NamedSharding(mesh, P("data")))

  Args:
    ds: yields host batches (numpy pytrees), e.g. a `RemoteDataset`, which
      then receives into page-locked memory when the devices are GPUs
      (`receive_page_locked`).
    sharding: a `jax.sharding.Sharding` for every leaf (typically a
      NamedSharding whose first mesh axis splits the batch), or a pytree of
      them matching the batch.
    cpu_buffer: host batches read ahead of the transfer.
    device_buffer: batches already on the devices, ahead of the step.
    process_layout: (h, H) for multi-process JAX; defaults to
      (jax.process_index(), jax.process_count()) when JAX runs as several
      processes. Each process's `ds` must yield its rows h of H.

  Raises:
    ImportError: JAX is not installed (the `jax` extra).
    InvalidRequestError: on the first batch, if it does not divide over the
      mesh or the sharding's process layout disagrees with (h, H).
  """
  jax = _jax()
  receive_page_locked(ds, host_memory.for_platforms(
      d.platform for s in jax.tree.leaves(sharding) for d in s.device_set))
  layout = process_layout if process_layout is not None else jax_process_layout()
  if layout is not None and layout[1] == 1:
    layout = None
  shards = (getattr(ds, "shard_index", None), getattr(ds, "shard_count", None))
  if layout is not None and None not in shards and shards != layout:
    raise InvalidRequestError(
        f"{ds} reads shard {shards[0]} of {shards[1]}, but JAX runs this as "
        f"process {layout[0]} of {layout[1]}; each process must read its own rows "
        "(leave shard_index/shard_count unset to follow JAX)")
  return buffered_put(ds, PutOnMesh(sharding, layout), cpu_buffer, device_buffer)


def receive_page_locked(ds: object, memory: host_memory.HostMemory | None) -> None:
  """Makes `ds` (a RemoteDataset; anything else is left alone) receive into
  `memory`, unless it is None or the user chose the dataset's memory."""
  if memory is not None and getattr(ds, "host_memory", False) is None:
    ds.host_memory = memory


def buffered_put(ds: grain.IterDataset, put: Any, cpu_buffer: int,
                 device_buffer: int) -> grain.IterDataset:
  """Host read-ahead -> `put` -> device-side buffer (Grain's device_put shape)."""
  if cpu_buffer > 0:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer)
  ds = ds.map(put)
  if device_buffer > 0:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=device_buffer)
  return ds
