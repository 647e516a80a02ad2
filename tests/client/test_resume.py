"""Resuming from a saved cursor: same remaining stream, on any number of hosts."""

from __future__ import annotations

import itertools
import json

import grain
import pytest

from grain_elevator.client import (InvalidRequestError, RemoteDataset,
                                   StreamMismatchError)
from helpers import assert_streams_equal, assert_trees_equal, oracle_batch

pytestmark = pytest.mark.grain_contract  # run again on the lowest Grain admitted


@pytest.mark.parametrize("j", [0, 1, 7, 20])
def test_resume_in_a_new_client(server, j):
  with RemoteDataset(server.target, "aug2", 96) as ds:
    it = iter(ds)
    full = list(it)
  with RemoteDataset(server.target, "aug2", 96, prefetch=4) as ds:
    it = iter(ds)
    for _ in range(j):
      next(it)
    saved = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
  assert saved["step"] == j
  with RemoteDataset(server.target, "aug2", 96) as ds:
    it = iter(ds)
    it.set_state(saved)
    assert_streams_equal(it, full[j:])


def test_state_works_before_the_first_batch(server):
  with RemoteDataset(server.target, "plain", 64) as ds:
    state = iter(ds).get_state()
  assert state["step"] == 0 and state["dataset"] == "plain"


def test_cursor_is_global_so_any_host_count_resumes_it(server, oracle):
  """A state saved by host 3 of 4 resumes hosts of a 2-host job at the same step."""
  with RemoteDataset(server.target, "seed3", 64, shard_index=3, shard_count=4) as ds:
    it = iter(ds)
    for _ in range(5):
      next(it)
    saved = it.get_state()
  for h in range(2):
    with RemoteDataset(server.target, "seed3", 64, shard_index=h, shard_count=2) as ds:
      it = iter(ds)
      it.set_state(saved)
      assert_trees_equal(next(it), oracle_batch(oracle, "seed3", 5, 64, h, 2))


@pytest.mark.parametrize("embedded", [False, True])
def test_assert_equal_output_after_checkpoint(server, config_path, embedded):
  if embedded:
    ds = RemoteDataset.embedded(config_path, "plain", 100)
  else:
    ds = RemoteDataset(server.target, "plain", 100, prefetch=3)
  with ds:
    grain.experimental.assert_equal_output_after_checkpoint(ds)


def test_set_state_mid_stream_discards_read_ahead(server, oracle):
  with RemoteDataset(server.target, "aug2", 96, prefetch=8) as ds:
    it = iter(ds)
    for _ in range(3):
      next(it)  # steps 3..10 are now in flight
    start = it.get_state()
    it.set_state({**start, "step": 15})
    assert_trees_equal(next(it), oracle_batch(oracle, "aug2", 15, 96))
    it.set_state({**start, "step": 1})
    assert_trees_equal(next(it), oracle_batch(oracle, "aug2", 1, 96))


@pytest.mark.parametrize("field,value,message", [
    ("dataset", "plain", "dataset: saved 'plain', this stream has 'aug2'"),
    ("seed", 8, "seed: saved 8, this stream has 7"),
    ("config_fingerprint", "0123456789abcdef", "config_fingerprint: saved"),
])
def test_cursor_of_another_stream_is_refused(server, field, value, message):
  with RemoteDataset(server.target, "aug2", 96) as ds:
    it = iter(ds)
    state = it.get_state()
    with pytest.raises(StreamMismatchError, match=message):
      it.set_state({**state, field: value})


@pytest.mark.parametrize("mutate,message", [
    (lambda s: {**s, "step": -1}, "step must be an integer >= 0"),
    (lambda s: {**s, "step": "3"}, "step must be an integer >= 0"),
    (lambda s: {**s, "step": 21}, "past the end of dataset 'aug2', which has 20 steps"),
    (lambda s: {k: v for k, v in s.items() if k != "seed"}, "missing seed"),
    (lambda s: [1, 2], "must be a dict"),
])
def test_bad_cursor_is_refused(server, mutate, message):
  with RemoteDataset(server.target, "aug2", 96) as ds:
    it = iter(ds)
    with pytest.raises(InvalidRequestError, match=message):
      it.set_state(mutate(it.get_state()))
    assert it.get_state()["step"] == 0  # a refused state changes nothing


def test_resume_at_the_end_yields_nothing(server):
  with RemoteDataset(server.target, "aug2", 96) as ds:
    it = iter(ds)
    it.set_state({**it.get_state(), "step": 20})
    assert list(it) == []


def test_resume_deep_into_an_endless_stream(server, oracle):
  """O(1) resume: step 10^6 of an endless dataset is as cheap as step 0."""
  with RemoteDataset(server.target, "forever", 128, shard_index=1, shard_count=2) as ds:
    it = iter(ds)
    it.set_state({**it.get_state(), "step": 10**6})
    got = list(itertools.islice(it, 2))
  for i, batch in enumerate(got):
    assert_trees_equal(batch, oracle_batch(oracle, "forever", 10**6 + i, 128, 1, 2))
