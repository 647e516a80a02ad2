"""The iterator's skeleton (client/iterator.py), whichever its reader: steps
delivered in order, a state that resumes anywhere (Grain's own check, at
every step, each state through JSON into a fresh iterator), the request
each chunk is, the meter, and closing. Against an in-memory backend
(fake_backend.py): no server, no pipeline."""

from __future__ import annotations

import json
from typing import Callable

import grain
import numpy as np
import pytest

from grain_elevator.client import state as state_lib
from grain_elevator.client.iterator import Arrivals, ClientIterator
from grain_elevator.client.read_spec import Kind
from grain_elevator.client.step_iterator import StepIterator
from grain_elevator.client.stream_iterator import StreamIterator
from grain_elevator.client.transport.connection import Step
from grain_elevator.client.transport.options import TransportOptions
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import ElevatorError, StreamMismatchError
from fake_backend import FakeBackend, Restartable, read_spec, step_info, stream_info

READERS = {Kind.STEP: StepIterator, Kind.STREAM: StreamIterator}
# (prefetch, steps_per_request): the default window, on demand, and fixed ones.
WINDOWS = [(None, None), (0, 1), (3, 2), (5, 4)]


def _info(kind: Kind):
  return step_info(num_records=40) if kind is Kind.STEP else stream_info()


def _backend(kind: Kind) -> FakeBackend:
  return FakeBackend(_info(kind), stream_end=60)


def _new(kind: Kind, g: int = 4, h: int = 0, n: int = 1, *, prefetch: int | None = None,
         steps_per_request: int | None = None,
         compression: str = "none") -> Callable[[], ClientIterator]:
  """A maker of fresh iterators, each with a backend of its own (an
  iterator closes its backend when it closes, as RemoteDataset's do)."""
  def make() -> ClientIterator:
    backend = _backend(kind)
    spec = read_spec(backend.info, g, h, n, prefetch=prefetch, transport=TransportOptions(
        steps_per_request=steps_per_request, compression=compression))
    assert spec.kind is kind
    return READERS[kind](spec, backend)
  return make


def _expected(kind: Kind, g: int, h: int = 0, n: int = 1) -> list[np.ndarray]:
  """Every step of host h of n: by step, the contract's records; as a
  stream, the batches from one position to the next, until its end."""
  backend = _backend(kind)
  steps = []
  if kind is Kind.STEP:
    for k in range(backend.info.total_steps(g)):
      values, _ = backend.global_batch(k, g)
      steps.append(values)
  else:
    at = 0
    while at < backend.stream_end:
      values, at = backend.global_batch(len(steps), g, at=at)
      steps.append(values)
  rows = g // n
  return [v[h * rows:(h + 1) * rows] for v in steps]


def _read(it: ClientIterator) -> list[np.ndarray]:
  try:
    return [step["x"] for step in it]
  finally:
    it.close()


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("prefetch,steps_per_request", WINDOWS)
@pytest.mark.parametrize("h,n", [(0, 1), (1, 2)])
def test_every_step_arrives_once_in_order(kind, prefetch, steps_per_request, h, n):
  got = _read(_new(kind, 4, h, n, prefetch=prefetch, steps_per_request=steps_per_request)())
  want = _expected(kind, 4, h, n)
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f"step {k}")


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("prefetch,steps_per_request", [(None, None), (0, 1), (3, 2)])
def test_it_resumes_after_a_checkpoint_at_every_step(kind, prefetch, steps_per_request):
  grain.experimental.assert_equal_output_after_checkpoint(Restartable(
      _new(kind, 4, 1, 2, prefetch=prefetch, steps_per_request=steps_per_request)))


@pytest.mark.parametrize("kind", list(Kind))
def test_a_state_resumes_on_another_host_count(kind):
  """The cursor is global: saved by host 0 of 1, it resumes host 1 of 2 at
  the same step."""
  first = _new(kind, 4)()
  for _ in range(3):
    next(first)
  state = json.loads(json.dumps(first.get_state()))
  first.close()
  second = _new(kind, 4, 1, 2)()
  second.set_state(state)
  got = _read(second)
  want = _expected(kind, 4, 1, 2)[3:]
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", list(Kind))
def test_a_skip_written_into_a_state_is_made_on_restore(kind):
  """`elevator cursor skip` writes a skip into a saved state (state.with_skip):
  the iterator that loads it goes on past the skipped steps."""
  it = _new(kind, 4, prefetch=2, steps_per_request=1)()
  next(it)
  state = state_lib.with_skip(it.get_state(), 3)
  it.close()
  resumed = _new(kind, 4, prefetch=2, steps_per_request=1)()
  resumed.set_state(json.loads(json.dumps(state)))
  assert resumed.get_state()["step"] == 4
  assert resumed.get_state()["skips"] == [[1, 4]]
  np.testing.assert_array_equal(next(resumed)["x"], _expected(kind, 4)[4])
  resumed.close()


def test_a_state_of_another_dataset_is_refused():
  steps = _new(Kind.STEP)()
  state = steps.get_state()
  steps.close()
  stream = _new(Kind.STREAM)()
  with pytest.raises(StreamMismatchError, match="dataset: saved 'steps', this stream has 'stream'"):
    stream.set_state(state)
  stream.close()


@pytest.mark.parametrize("kind", list(Kind))
def test_every_chunk_is_its_spec_s_request_in_the_transport_s_compression(kind):
  """The skeleton asks for this host's rows of each chunk, compressed as
  the transport says; a stream's skip sends no batch, so asks for none
  (the fake refuses a compressed skip)."""
  it = _new(kind, 8, 1, 2, prefetch=2, steps_per_request=2, compression="zstd")()
  next(it)
  it.skip(2)
  next(it)
  backend = it._backend  # pylint: disable=protected-access
  it.close()
  fetches = [r for r in backend.requests if r.compression]
  assert fetches and all(
      (r.dataset, r.global_batch_size, r.shard_index, r.shard_count, r.compression)
      == (backend.info.name, 8, 1, 2, pb.COMPRESSION_ZSTD) for r in fetches)
  skips = [r for r in backend.requests if not r.compression]
  assert len(skips) == (1 if kind is Kind.STREAM else 0)


@pytest.mark.parametrize("kind", list(Kind))
def test_the_meter_counts_what_was_delivered(kind):
  it = _new(kind, 4, 0, 2)()
  for _ in range(3):
    next(it)
  stats = it.stats()
  it.close()
  assert (stats.steps, stats.bytes) == (3, 3 * 2 * 8)  # 2 rows of one int64


@pytest.mark.parametrize("kind", list(Kind))
def test_a_closed_iterator_refuses_and_closed_its_backend(kind):
  it = _new(kind)()
  next(it)
  it.close()
  it.close()  # twice is fine
  assert it._backend.closed  # pylint: disable=protected-access
  with pytest.raises(ElevatorError, match=r"RemoteDataset\(targets=\['fake:1'\], dataset="
                     r"'\w+', G=4, h=0/1\) iterator is closed"):
    next(it)


def test_arrivals_tell_each_step_as_it_is_appended():
  told = []
  arrivals = Arrivals(told.append)
  steps = [Step([np.zeros(1)], ""), Step([np.ones(1)], "")]
  for step in steps:
    arrivals.append(step)
  assert told == steps == list(arrivals)
