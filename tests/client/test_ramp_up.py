"""A job may change its global batch size at a checkpoint (a ramp-up, 48 ->
96, or to a size the position is no multiple of, 48 -> 64): it resumes at
the record it reached, nothing lost or repeated, remote and embedded, on 1
and 2 hosts. The expected records come from the G=16 stream read straight
through (16 divides every G here)."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.client import InvalidRequestError, RemoteDataset, StreamMismatchError
from helpers import assert_trees_equal, oracle_batch

DATASET, G0, BEFORE, AFTER = "aug2", 48, 3, 4  # aug2: 1,000 records, 2 epochs


def _records(oracle, start: int, stop: int) -> dict[str, np.ndarray]:
  """Records [start, stop) of the stream, from G=16 global batches."""
  batches = [oracle_batch(oracle, DATASET, k, 16) for k in range(start // 16, -(-stop // 16))]
  whole = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
  skip = start - start // 16 * 16
  return {key: v[skip:skip + stop - start] for key, v in whole.items()}


def _host_rows(records: dict[str, np.ndarray], g: int, step: int, h: int, n: int):
  rows = slice(step * g + h * g // n, step * g + (h + 1) * g // n)
  return {key: v[rows] for key, v in records.items()}


def _open(server, config_path, remote: bool, g: int, h: int, n: int) -> RemoteDataset:
  if remote:
    return RemoteDataset(server.target, DATASET, g, shard_index=h, shard_count=n)
  return RemoteDataset.embedded(config_path, DATASET, g, shard_index=h, shard_count=n)


@pytest.mark.parametrize("remote", [True, False], ids=["remote", "embedded"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("new_g", [96, 64])
def test_a_new_batch_size_resumes_at_the_record_reached(server, config_path, oracle,
                                                        remote, n, new_g):
  reached = G0 * BEFORE
  records = _records(oracle, 0, reached + AFTER * new_g)
  for h in range(n):
    with _open(server, config_path, remote, G0, h, n) as before:
      it = iter(before)
      for k in range(BEFORE):
        assert_trees_equal(next(it), _host_rows(records, G0, k, h, n), f"G0 step {k}")
      saved = it.get_state()
    assert saved == {**saved, "step": BEFORE, "global_batch_size": G0}
    with _open(server, config_path, remote, new_g, h, n) as after:
      it = iter(after)
      it.set_state(saved)
      rest = {key: v[reached:] for key, v in records.items()}
      for k in range(AFTER):
        assert_trees_equal(next(it), _host_rows(rest, new_g, k, h, n), f"G={new_g} step {k}")
      state = it.get_state()
      assert (state["step"], state["record_offset"], state["global_batch_size"]) == (
          AFTER, reached, new_g)
      # The new state resumes a fresh iterator where this one goes on.
      again = iter(after)
      again.set_state(state)
      assert_trees_equal(next(again), next(it), "resumed from the new state")


def test_the_stream_ends_at_its_last_whole_batch_after_a_change(server):
  """2,000 records; 144 used at G=48, then G=64: (2000 - 144) // 64 = 29
  more steps, then StopIteration."""
  with RemoteDataset(server.target, DATASET, G0) as before:
    it = iter(before)
    for _ in range(BEFORE):
      next(it)
    saved = it.get_state()
  with RemoteDataset(server.target, DATASET, 64, prefetch=4) as after:
    it = iter(after)
    it.set_state(saved)
    assert sum(1 for _ in it) == (2000 - G0 * BEFORE) // 64 == 29


def test_a_change_back_and_a_second_change_compose(server, oracle):
  """48 -> 64 -> 48: each change resumes at the record reached."""
  records = _records(oracle, 0, 48 * 3 + 64 * 2 + 48 * 2)
  with RemoteDataset(server.target, DATASET, 48) as a:
    it = iter(a)
    for _ in range(3):
      next(it)
    first = it.get_state()
  with RemoteDataset(server.target, DATASET, 64) as b:
    it = iter(b)
    it.set_state(first)
    next(it), next(it)
    second = it.get_state()
  with RemoteDataset(server.target, DATASET, 48) as c:
    it = iter(c)
    it.set_state(second)
    assert it.get_state() == {**second, "step": 0, "global_batch_size": 48,
                              "record_offset": 48 * 3 + 64 * 2}
    rest = {key: v[48 * 3 + 64 * 2:] for key, v in records.items()}
    for k in range(2):
      assert_trees_equal(next(it), _host_rows(rest, 48, k, 0, 1), f"step {k}")


@pytest.mark.parametrize("change,error,message", [
    ({"seed": 8}, StreamMismatchError, "seed: saved 8"),
    ({"record_offset": -5}, InvalidRequestError, "record_offset must be an integer >= 0"),
    ({"step": 42, "global_batch_size": 48}, InvalidRequestError,
     "past the end of dataset 'aug2', which has 41 steps of global batch size 48"),
    ({"global_batch_size": 0}, InvalidRequestError, "global_batch_size must be an integer >= 1"),
])
def test_states_of_other_streams_and_bad_offsets_are_refused(server, change, error, message):
  with RemoteDataset(server.target, DATASET, 64) as ds:
    it = iter(ds)
    state = {**it.get_state(), "step": 3, "global_batch_size": 48}
    with pytest.raises(error, match=message):
      it.set_state({**state, **change})
    assert it.get_state()["step"] == 0 and "record_offset" not in it.get_state()
