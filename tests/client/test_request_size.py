"""Requests are sized by the time a server worker takes to make them
(client/request_size.py), from the production times the servers report
(server/serving/production_time.py).

The rule is pinned on the requests a client makes, never on a time: a step
that waits 160 ms at the server (tools/bench/sleeping.py, whose workers run
at 0.9-1.1 of that) takes no less than 0.14 s on any machine, so it always
gets one-step requests; a step of a few tiny decoded images takes a
fraction of that."""

from __future__ import annotations

import pathlib

import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.client import request_size
from grain_elevator.client.request_size import REQUEST_S, RequestSize
from grain_elevator.client.transport.connection import CancelToken
from grain_elevator.client.transport.pool import ConnectionPool
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.server import Server, ServerOptions
import datasets
from helpers import assert_streams_equal

G = 8
SLEEPING = "grain_elevator.tools.bench.sleeping"
STEPS = 40


# -- the rule ---------------------------------------------------------------

def test_before_any_time_a_request_is_one_step_and_a_server_saying_none_leaves_bytes():
  size = RequestSize(48, timed=True)
  assert size.steps == request_size.FIRST_STEPS == 1
  assert size.observe(0.0)  # an older server: says nothing
  assert size.steps == 48
  assert not size.observe(0.0)


def test_costly_steps_get_one_step_requests_and_cheap_ones_the_bytes_rule():
  costly = RequestSize(190, timed=True)  # 1 KiB records of 3 ms, G=64: 12 MiB is 190 steps
  for _ in range(5):
    costly.observe(0.19)
  assert costly.steps == 1
  cheap = RequestSize(3, timed=True)  # the bench's large steps: 3 to 12 MiB
  for _ in range(5):
    cheap.observe(0.005)
  assert cheap.steps == 3


@pytest.mark.parametrize("step_s,steps", [(0.1, 1), (0.04, 2), (0.02, 4), (0.011, 8),
                                          (0.001, 64)])
def test_a_request_is_the_power_of_two_of_steps_within_its_time(step_s, steps):
  size = RequestSize(1000, timed=True)
  size.observe(step_s)
  assert size.steps == steps
  assert size.steps * step_s <= REQUEST_S + 1e-9


def test_the_size_follows_a_changing_time_without_flapping():
  """A mixture's schedule or a cold cache: the average moves, the size
  follows; times that jitter around a boundary keep it."""
  size = RequestSize(1000, timed=True)
  for _ in range(20):
    size.observe(0.012)  # ideal 8.3: 8
  assert size.steps == 8
  seen = set()
  for k in range(200):
    seen.add(size.steps)
    size.observe(0.012 if k % 2 else 0.0135)  # ideal 7.4-8.3 around 8
  assert seen == {8}
  for _ in range(30):
    size.observe(0.1)  # costlier now
  assert size.steps == 1
  for _ in range(30):
    size.observe(0.0001)
  assert size.steps == 512


def test_a_size_given_or_embedded_is_kept():
  size = RequestSize(7, timed=False)
  assert size.steps == 7
  assert not size.observe(0.5)
  assert size.steps == 7


# -- against a real server ---------------------------------------------------

@pytest.fixture(scope="module")
def costly_and_cheap(tmp_path_factory: pytest.TempPathFactory, data_dir: pathlib.Path) -> str:
  """"costly": 20 ms of waiting a record (160 ms a step; no batch
  transform, which a server would check at start on a few dozen records);
  "cheap": the same records decoded, nothing else."""
  shards = data_dir / datasets.SHARDS
  return datasets.write_config(
      tmp_path_factory.mktemp("sizes") / "sizes.toml",
      costly=datasets.images(shards, pipeline=f"{SLEEPING}:pixels", seed=3, num_epochs=0,
                             options={"sleep_us_per_record": 20_000}),
      cheap=datasets.images(shards, seed=3, num_epochs=0))


def _read(target: str, dataset: str, steps: int, **kwargs) -> tuple[list, list[int]]:
  """`steps` steps of `dataset` by a default client, and the size of each
  request it made (seen at its backend, on their way to the servers)."""
  sizes: list[int] = []
  with RemoteDataset(target, dataset, G, stats_log_s=0, **kwargs) as ds:
    it = iter(ds)
    fetch = it._backend.fetch  # pylint: disable=protected-access

    def spied(request, *args, **kw):
      sizes.append(request.num_steps)
      return fetch(request, *args, **kw)

    it._backend.fetch = spied  # pylint: disable=protected-access
    return [next(it) for _ in range(steps)], sizes


def test_a_costly_small_step_gets_short_requests_and_a_cheap_one_does_not(
    costly_and_cheap, tmp_path):
  """Both datasets' steps are 8 tiny images: by bytes, requests of hundreds
  of steps. The costly one's are one step each, all along; the cheap one's
  grow past one step once its first step has said what it costs. Both are
  the embedded stream, step for step."""
  with Server(costly_and_cheap, ServerOptions(port=0, workers=2)) as server:
    target = f"127.0.0.1:{server.port}"
    costly, costly_sizes = _read(target, "costly", 8)
    cheap, cheap_sizes = _read(target, "cheap", STEPS)
    given, given_sizes = _read(target, "costly", 8,
                               transport=TransportOptions(steps_per_request=4))
  assert set(costly_sizes) == {1}, costly_sizes
  assert cheap_sizes[0] == 1 and max(cheap_sizes) >= 8, cheap_sizes
  assert set(given_sizes) == {4}, given_sizes  # the trainer's own size is kept
  for name, got in (("costly", costly), ("cheap", cheap), ("costly", given)):
    with RemoteDataset.embedded(costly_and_cheap, name, G, prefetch=0) as local:
      it = iter(local)
      assert_streams_equal(got, [next(it) for _ in range(len(got))])


def test_a_server_says_the_production_time_only_when_asked(costly_and_cheap):
  """Asked, each step of the costly dataset says at least its 160 ms of
  waiting (times the sleeping worker's own speed, 0.9 at the least); not
  asked, nothing (the bytes an older client expects)."""
  with Server(costly_and_cheap, ServerOptions(port=0, workers=1)) as server:
    pool = ConnectionPool([f"127.0.0.1:{server.port}"])
    try:
      (info,) = pool.describe("costly", G)
      for timed in (True, False):
        request = pb.BatchRequest(
            dataset="costly", global_batch_size=G, shard_count=1, start_step=0, num_steps=2,
            config_fingerprint=info.config_fingerprint, report_production=timed)
        steps = pool.fetch(request, CancelToken())
        times = [s.production_s for s in steps]
        if timed:
          assert all(t >= 0.9 * 0.16 for t in times), times
        else:
          assert times == [0.0, 0.0], times
    finally:
      pool.close()

