"""Trainers reading the same stream share each step: one server produces it
once and serves it to all, bit-identical to what a lone trainer gets.

Counted from the server's own metrics: elevator_batch_seconds_count is the
steps produced, elevator_batch_cache_hits_total the steps served from the
cache (server/serving/batch_cache.py)."""

from __future__ import annotations

import threading

import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
from helpers import assert_streams_equal, oracle_batch

DATASET, G = "aug2", 50  # 2 epochs of 1,000 records: 40 steps
STEPS = 40


def _counts(server: Server) -> tuple[float, float, float]:
  """(steps served, produced, from the cache) of DATASET so far."""
  m = top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=10)
  label = (("dataset", DATASET),)
  return (m.get(("elevator_batches_total", label), 0.0),
          m.get(("elevator_batch_seconds_count", label), 0.0),
          m.get(("elevator_batch_cache_hits_total", label), 0.0))


def _read_together(target: str, readers: int, **kwargs) -> list[list]:
  """Each reader's whole stream, all reading at once from their own threads."""
  out: list[list] = [[] for _ in range(readers)]
  errors: list[BaseException] = []
  start = threading.Barrier(readers)

  def read(i: int) -> None:
    try:
      with RemoteDataset(target, DATASET, G, **kwargs) as ds:
        it = iter(ds)
        start.wait(30)
        out[i] = list(it)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert not errors, errors
  return out


@pytest.fixture(scope="module")
def oracle_stream(config_path):
  with RemoteDataset.embedded(config_path, DATASET, G, prefetch=0) as local:
    return list(local)


@pytest.mark.parametrize("readers,kind", [(2, "bulk"), (4, "bulk"), (2, "grpc")])
def test_identical_readers_get_each_step_produced_once(config_path, oracle_stream,
                                                       readers, kind):
  with Server(config_path, ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    streams = _read_together(server.target, readers,
                             transport=TransportOptions(kind=kind, steps_per_request=4))
    for got in streams:
      assert assert_streams_equal(got, oracle_stream) == STEPS
    served, produced, hits = _counts(server)
  assert served == readers * STEPS
  assert produced == STEPS, "each step produced once, whichever worker served it"
  assert hits == (readers - 1) * STEPS


def test_a_reader_resuming_elsewhere_shares_from_its_next_whole_request(
    config_path, oracle_stream):
  options = dict(transport=TransportOptions(steps_per_request=4))
  with Server(config_path, ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    with RemoteDataset(server.target, DATASET, G, **options) as first:
      assert assert_streams_equal(list(first), oracle_stream) == STEPS
      it = iter(first)
      for _ in range(7):
        next(it)
      state = it.get_state()
    with RemoteDataset(server.target, DATASET, G, **options) as later:
      it = iter(later)
      it.set_state(state)  # step 7: its first request is [7, 8), then [8, 12), ...
      assert assert_streams_equal(list(it), oracle_stream[7:]) == STEPS - 7
    served, produced, hits = _counts(server)
  # The first reader read 0..39, then 0..6 again (and what its window
  # fetched ahead); the second 7..39: every step was produced once,
  # whatever the requests' boundaries.
  assert served >= STEPS + 7 + STEPS - 7
  assert produced == STEPS and hits == served - STEPS


def test_readers_of_other_streams_share_nothing_and_get_their_own(config_path, oracle):
  with Server(config_path, ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    for h in (0, 1):  # the two hosts of H=2: other rows, other cache entries
      with RemoteDataset(server.target, DATASET, G, shard_index=h, shard_count=2) as ds:
        for k, batch in enumerate(ds):
          assert_streams_equal([batch], [oracle_batch(oracle, DATASET, k, G, h, 2)])
    _, produced, hits = _counts(server)
  assert produced == 2 * STEPS and hits == 0


def test_batch_cache_mb_zero_turns_sharing_off(config_path, oracle_stream):
  with Server(config_path, ServerOptions(port=0, workers=2, metrics_port=0,
                                         batch_cache_mb=0)) as server:
    for got in _read_together(server.target, 2):
      assert_streams_equal(got, oracle_stream)
    _, produced, hits = _counts(server)
  assert produced == 2 * STEPS and hits == 0
