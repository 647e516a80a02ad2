"""A default client sizes itself from the servers' workers and adapts its
window to the trainer, against real servers whose pipeline waits per record
(tools/bench/sleeping.py: a worker busy without taking a core).

Everything here waits for a count (the server's in-flight requests, the
window the client's stats report), never for a time."""

from __future__ import annotations

import collections
import pathlib
import threading
import time

import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.client.window import REQUESTS_PER_WORKER, STREAM_REQUESTS
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
import datasets
from helpers import assert_streams_equal

G = 8  # rows of 4x4x3 images: tiny steps
SLEEPING = "grain_elevator.tools.bench.sleeping"


def _sleeping_config(root: pathlib.Path, data_dir: pathlib.Path, sleep_us: int,
                     batch: bool = True) -> str:
  """"slow": the conftest's shards through tools/bench/sleeping.py's pixels,
  each record waiting `sleep_us`, repeating forever. `batch`: with its
  batch transform, which a server checks at start against the pipeline on
  a few dozen records (seconds, at long waits: leave it out there)."""
  batch_transform = {"batch_transform": f"{SLEEPING}:pixels_batch"} if batch else {}
  return datasets.write_config(
      root / "sleeping.toml",
      slow=datasets.images(data_dir / datasets.SHARDS, pipeline=f"{SLEEPING}:pixels",
                           seed=3, num_epochs=0, options={"sleep_us_per_record": sleep_us},
                           **batch_transform))


@pytest.fixture(scope="module")
def sleeping_1ms(tmp_path_factory: pytest.TempPathFactory, data_dir: pathlib.Path) -> str:
  """Steps of 8 ms of waiting, for the tests that read from a server only
  (the session's in-process servers of it, one per worker count)."""
  return _sleeping_config(tmp_path_factory.mktemp("sleeping"), data_dir, sleep_us=1_000)


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def _workers_of(it) -> collections.Counter:
  return collections.Counter(s.conn.server.worker_index
                             for s in it._backend.data_slots())  # pylint: disable=protected-access


def test_a_default_client_keeps_two_requests_in_flight_on_every_worker(tmp_path, data_dir):
  """4 workers, each step 2 s of waiting: the default client opens two
  connections to each worker and keeps a request on each (of one step:
  client/request_size.py). The fixed default (4 connections) never had more
  than 4 requests at the server."""
  workers = 4
  config = _sleeping_config(tmp_path, data_dir, sleep_us=250_000, batch=False)
  with Server(config, ServerOptions(port=0, workers=workers, metrics_port=0)) as server, \
       RemoteDataset(f"127.0.0.1:{server.port}", "slow", G, stats_log_s=0) as ds:
    it = iter(ds)
    assert _workers_of(it) == {w: REQUESTS_PER_WORKER for w in range(workers)}
    assert it.stats().window >= REQUESTS_PER_WORKER * workers  # steps: a request each, or more

    def inflight() -> float:
      m = top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=10)
      return m.get(("elevator_inflight_requests", ()), 0.0)

    first = threading.Thread(target=next, args=(it,))  # the window's requests go out
    first.start()
    try:  # while the first step is made (the requests of a worker take turns)
      _wait_for(lambda: inflight() >= REQUESTS_PER_WORKER * workers,
                f"{REQUESTS_PER_WORKER * workers} requests in flight at the server")
    finally:
      first.join()


def test_the_window_grows_while_the_trainer_waits_and_shrinks_while_it_does_not(
    serve, sleeping_1ms, oracle_of):
  """A trainer that takes each step at once waits on a server whose steps
  take 8 ms: the window grows to its most. The same trainer, waiting until
  every step asked for has arrived before taking the next, never waits:
  the window shrinks, one request at a time, to one request. What it
  delivers stays the embedded stream, step for step."""
  config = sleeping_1ms
  with RemoteDataset(serve(config, workers=2).target, "slow", G, stats_log_s=0,
                     transport=TransportOptions(steps_per_request=1)) as ds:
    it = iter(ds)
    start = it.stats().window
    assert start == REQUESTS_PER_WORKER * 2  # one step a request, a request a connection
    most = it._window.most  # pylint: disable=protected-access
    assert most > start
    got = []
    while it.stats().window < most:  # takes each step at once: waits
      got.append(next(it))
      assert len(got) < 400, f"the window stayed at {it.stats().window} of {most}"

    def all_arrived() -> bool:
      return all(c.future.done() for c in list(it._chunks))  # pylint: disable=protected-access

    while it.stats().window > 1:  # takes a step only once all have come: never waits
      _wait_for(all_arrived, "the steps in flight")
      got.append(next(it))
      assert len(got) < 1000, f"the window stayed at {it.stats().window}"
    assert it.stats().steps == len(got)
  assert_streams_equal(got, oracle_of(config, "slow", len(got)))


@pytest.fixture
def oracle_of():
  def steps(config: str, dataset: str, n: int) -> list:
    with RemoteDataset.embedded(config, dataset, G, prefetch=0) as local:
      it = iter(local)
      return [next(it) for _ in range(n)]
  return steps


def test_explicit_connections_and_prefetch_are_kept_as_given(serve, sleeping_1ms):
  """connections_per_target=2 on 4 workers: one each, not two; prefetch=3:
  three steps in flight, while the trainer waits on every one."""
  server = serve(sleeping_1ms, workers=4)
  with RemoteDataset(server.target, "slow", G, prefetch=3, stats_log_s=0,
                     transport=TransportOptions(connections_per_target=2,
                                                steps_per_request=1)) as ds:
    it = iter(ds)
    assert sum(_workers_of(it).values()) == 4
    for _ in range(60):  # the trainer waits on each: a default window would grow
      next(it)
      assert it.stats().window == 3
  with RemoteDataset(server.target, "slow", G, stats_log_s=0) as ds:
    assert _workers_of(iter(ds)) == {w: REQUESTS_PER_WORKER for w in range(4)}


def test_a_stream_opens_one_connection_per_worker_and_a_fixed_window(serve, few_config):
  """A stream's requests go one at a time to the worker owning it: more
  connections would idle, and its window does not adapt."""
  with RemoteDataset(serve(few_config, workers=3).target, "few", G, stats_log_s=0) as ds:
    it = iter(ds)
    assert _workers_of(it) == {0: 1, 1: 1, 2: 1}
    window = it.stats().window
    steps_per_request = it._window.steps_per_request  # pylint: disable=protected-access
    assert window == STREAM_REQUESTS * steps_per_request
    for _ in range(3 * window):
      next(it)
    assert it.stats().window == window


def test_embedded_mode_has_a_window_without_a_server(config_path):
  with RemoteDataset.embedded(config_path, "forever", G, stats_log_s=0) as local, \
       RemoteDataset.embedded(config_path, "forever", G, prefetch=0) as oracle:
    it = iter(local)
    assert it.stats().window > 0
    assert assert_streams_equal([next(it) for _ in range(50)],
                                [x for x, _ in zip(oracle, range(50))]) == 50
