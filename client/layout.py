"""Which host this is: (h, H) from the framework the trainer already runs.

A `RemoteDataset` built without `shard_index`/`shard_count` reads the rows
of this process's place in the job: JAX's process index and count when
`jax.distributed` runs several processes, else torch.distributed's rank and
world size when it is initialized with several ranks, else (0, 1). Both are
looked up only in modules the trainer has already imported and initialised,
so this never starts a backend or imports a framework.
"""

from __future__ import annotations

import sys


def jax_process_layout() -> tuple[int, int] | None:
  """(process_index, process_count) if JAX runs as several processes, else None."""
  jax = sys.modules.get("jax")
  if jax is None or not jax.distributed.is_initialized():
    return None
  if jax.process_count() <= 1:
    return None
  return jax.process_index(), jax.process_count()


def torch_process_layout() -> tuple[int, int] | None:
  """(rank, world_size) of torch.distributed's default group if it is
  initialized with several ranks, else None."""
  torch = sys.modules.get("torch")
  dist = getattr(torch, "distributed", None)
  if dist is None or not dist.is_available() or not dist.is_initialized():
    return None
  if dist.get_world_size() <= 1:
    return None
  return dist.get_rank(), dist.get_world_size()


def process_layout() -> tuple[int, int] | None:
  """JAX's layout, else torch.distributed's, else None (one host)."""
  return jax_process_layout() or torch_process_layout()
