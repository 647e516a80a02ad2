"""Batches land on a sharded mesh holding exactly the contract's rows."""

from __future__ import annotations

import itertools

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from grain_elevator.client import InvalidRequestError, RemoteDataset, to_device
from helpers import oracle_batch


def _assert_shards_hold_oracle_rows(batch, expected):
  for key, array in batch.items():
    want = np.asarray(jax.numpy.asarray(expected[key]))  # x64 off: int64 -> int32
    assert array.shape == want.shape
    for shard in array.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index],
                                    err_msg=f"{key} on {shard.device}")


@pytest.mark.parametrize("mesh_shape,axes,spec", [
    ((8,), ("data",), P("data")),
    ((4, 2), ("data", "model"), P("data")),           # replicated over "model"
    ((4, 2), ("data", "model"), P(("data", "model"))),  # batch over both axes
])
def test_each_device_holds_its_rows(server, oracle, mesh_shape, axes, spec):
  assert jax.device_count() == 8
  mesh = jax.make_mesh(mesh_shape, axes)
  with RemoteDataset(server.target, "aug2", 96) as remote:
    ds = to_device(remote, NamedSharding(mesh, spec))
    it = iter(ds)
    for k, batch in enumerate(itertools.islice(it, 12)):
      assert batch["image"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
      _assert_shards_hold_oracle_rows(batch, oracle_batch(oracle, "aug2", k, 96))


def test_pytree_of_shardings(server, oracle):
  mesh = jax.make_mesh((8,), ("data",))
  shardings = {"id": NamedSharding(mesh, P()), "image": NamedSharding(mesh, P("data")),
               "label": NamedSharding(mesh, P("data")), "noise": NamedSharding(mesh, P())}
  with RemoteDataset(server.target, "aug2", 96) as remote:
    batch = next(iter(to_device(remote, shardings)))
  assert batch["id"].sharding.is_fully_replicated
  _assert_shards_hold_oracle_rows(batch, oracle_batch(oracle, "aug2", 0, 96))


def test_state_round_trips_through_the_device_stages(server):
  mesh = jax.make_mesh((8,), ("data",))
  with RemoteDataset(server.target, "seed3", 64) as remote:
    ds = to_device(remote, NamedSharding(mesh, P("data")), cpu_buffer=4, device_buffer=3)
    it = iter(ds)
    for _ in range(5):
      next(it)
    # 5 consumed; up to 7 more sit in the buffers, but the state is step 5.
    assert it.get_state()["step"] == 5
  # Grain's checker compares with ==, so fetch the device arrays back first.
  fed = to_device(RemoteDataset(server.target, "seed3", 64), NamedSharding(mesh, P("data")))
  grain.experimental.assert_equal_output_after_checkpoint(
      fed.map(lambda batch: jax.tree.map(np.asarray, batch)))


def test_batch_that_does_not_divide_over_the_mesh(server):
  mesh = jax.make_mesh((8,), ("data",))
  with RemoteDataset(server.target, "seed3", 60) as remote:
    it = iter(to_device(remote, NamedSharding(mesh, P("data")), cpu_buffer=0, device_buffer=0))
    with pytest.raises(InvalidRequestError,
                       match="a batch of 60 rows does not divide over mesh axis data of size 8"):
      next(it)


def test_shards_must_follow_the_process_layout(server):
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(InvalidRequestError, match="reads shard 0 of 1, but JAX runs this as process 1 of 2"):
    to_device(RemoteDataset(server.target, "seed3", 64), NamedSharding(mesh, P("data")),
              process_layout=(1, 2))
