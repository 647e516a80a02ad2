"""The reader of a dataset that answers for any step (client/step_iterator.py):
chunks that end at multiples of their size wherever it resumes, skips and a
new G in O(1), the end of a finite dataset. Against an in-memory backend
(fake_backend.py); what every reader does is in test_iterator.py."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from grain_elevator.client.step_iterator import StepIterator
from grain_elevator.client.transport.options import TransportOptions
from grain_elevator.proto.errors import InvalidRequestError
from fake_backend import FakeBackend, Restartable, read_spec, step_info

RECORDS = 48


def _iterator(g: int = 4, h: int = 0, n: int = 1, *, prefetch: int | None = 4,
              steps_per_request: int | None = 4) -> StepIterator:
  backend = FakeBackend(step_info(num_records=RECORDS))
  transport = TransportOptions(steps_per_request=steps_per_request)
  return StepIterator(read_spec(backend.info, g, h, n, prefetch=prefetch, transport=transport),
                      backend)


def _records(first: int, g: int, h: int = 0, n: int = 1) -> np.ndarray:
  """Host h of n's rows of the global batch of `g` records from `first`."""
  rows = g // n
  return np.arange(first + h * rows, first + (h + 1) * rows)


def _chunks(it: StepIterator) -> list[tuple[int, int]]:
  return [(r.start_step, r.num_steps) for r in it._backend.requests]  # pylint: disable=protected-access


@pytest.mark.parametrize("resume_at", [0, 1, 5, 7])
def test_chunks_end_at_multiples_of_their_size_wherever_it_resumes(resume_at):
  """So every trainer asks for the same chunks, which a worker serves once
  (server/serving/batch_cache.py)."""
  first = _iterator()
  state = first.get_state()
  first.close()
  it = _iterator()
  it.set_state({**state, "step": resume_at})
  steps = list(it)
  assert len(steps) == RECORDS // 4 - resume_at
  chunks = sorted(_chunks(it))
  assert chunks[0][0] == resume_at
  for (start, num), (after, _) in zip(chunks, chunks[1:] + [(RECORDS // 4, 0)]):
    assert start + num == after, chunks  # no gap, no step asked for twice
    assert after % 4 == 0 or after == RECORDS // 4, chunks


def test_a_skip_asks_for_none_of_the_skipped_steps():
  it = _iterator(prefetch=0, steps_per_request=1)
  np.testing.assert_array_equal(next(it)["x"], _records(0, 4))
  it.skip(3)
  np.testing.assert_array_equal(next(it)["x"], _records(16, 4))
  state = it.get_state()
  it.close()
  assert (state["step"], state["skips"]) == (5, [[1, 4]])
  assert sorted(_chunks(it)) == [(0, 1), (4, 1)]


def test_a_skip_past_the_end_is_refused_and_the_iterator_stays():
  it = _iterator()
  next(it)
  with pytest.raises(InvalidRequestError, match=r"passes the end: the dataset has 12 steps"):
    it.skip(12)
  np.testing.assert_array_equal(next(it)["x"], _records(4, 4))
  it.close()


@pytest.mark.parametrize("g,h,n", [(8, 0, 1), (8, 1, 2), (2, 1, 2)])
def test_a_new_global_batch_size_goes_on_from_the_record_reached(g, h, n):
  """A state saved at step 3 of G=4 resumes at record 12 under another G,
  steps counted afresh (proto/contract.py); and resumes after a checkpoint
  at every step from there, each state through JSON."""
  saver = _iterator()
  for _ in range(3):
    next(saver)
  state = json.loads(json.dumps(saver.get_state()))
  saver.close()

  def resumed() -> StepIterator:
    it = _iterator(g, h, n)
    it.set_state(state)
    return it

  it = resumed()
  assert (it.get_state()["step"], it.get_state()["record_offset"]) == (0, 12)
  got = [step["x"] for step in it]
  it.close()
  assert len(got) == (RECORDS - 12) // g
  for k, rows in enumerate(got):
    np.testing.assert_array_equal(rows, _records(12 + k * g, g, h, n))
  grain.experimental.assert_equal_output_after_checkpoint(Restartable(resumed))


def test_the_end_of_a_finite_dataset_stops_it_and_its_threads():
  it = _iterator()
  assert len(list(it)) == RECORDS // 4
  with pytest.raises(StopIteration):
    next(it)
  assert it._pool is None  # pylint: disable=protected-access
  assert max(s + n for s, n in _chunks(it)) == RECORDS // 4  # nothing asked past the end
  it.close()


def test_a_state_past_the_end_is_refused():
  it = _iterator()
  state = it.get_state()
  with pytest.raises(InvalidRequestError, match="past the end of dataset 'steps'"):
    it.set_state({**state, "step": RECORDS // 4 + 1})
  it.close()
