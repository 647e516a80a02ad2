"""A worker's stream sessions (server/serving/stream_sessions.py), driven in
process against a real stream dataset: each global batch made once for its
hosts and dropped once all have passed it, memory within the budget and the
count whatever readers do, nothing kept of a refused position or a failed
production, a cancelled production stopped inside its batch, and every batch
exactly Grain's own, however sessions were evicted or replayed."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest

from grain_elevator.proto.errors import Cancelled, InvalidRequestError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import registry
from grain_elevator.server.data.streams import stream as stream_lib
from grain_elevator.server.serving.stream_sessions import StreamSessions

G = 16
_JOIN_S = 120.0


@pytest.fixture(scope="module")
def big(big_config: str) -> stream_lib.StreamDataset:
  ds = registry.Datasets(config_lib.load_config(big_config)).get("big")
  assert isinstance(ds, stream_lib.StreamDataset)
  return ds


@pytest.fixture(scope="module")
def grains(big) -> list[tuple[list[np.ndarray], str]]:
  """Grain's own first 120 global batches of G and the positions after them."""
  it = iter(big.pipeline(G))
  out = []
  for _ in range(120):
    batch = next(it)
    out.append(([batch[k] for k in sorted(batch)], stream_lib.dumps(it.get_state())))
  return out


def _position(big, grains, k: int) -> str:
  """Where global batch k starts."""
  return big.info.stream_start if k == 0 else grains[k - 1][1]


def _read(sessions, big, grains, first: int, count: int, host=(1, 0), **kwargs):
  """Batches [first, first+count) as `host` reads them; checked against Grain's."""
  got = list(sessions.batches(big, G, _position(big, grains, first), count, host, **kwargs))
  for k, ((leaves, state), _) in enumerate(got, first):
    want, want_state = grains[k]
    assert state == want_state, f"batch {k}: position"
    for a, b in zip(leaves, want):
      assert a.tobytes() == b.tobytes(), f"batch {k}: rows differ"
  return got


def _batch_bytes(grains) -> int:
  return sum(a.nbytes for a in grains[0][0])


def test_hosts_of_a_job_share_each_batch_and_it_goes_once_all_passed(big, grains):
  sessions = StreamSessions(64 << 20)
  made = [[m for _, m in _read(sessions, big, grains, 0, 4, host=(3, h))] for h in range(3)]
  assert made == [[True] * 4, [False] * 4, [False] * 4]
  assert sessions.nbytes == big.iterator_bytes(G) + 3 * 128  # the iterator, for the next chunk
  _read(sessions, big, grains, 4, 4, host=(3, 0))  # the next chunk takes that iterator over
  assert len(sessions) == 1


def test_a_host_reading_a_chunk_again_gets_it_again(big, grains):
  """A retry after its batches were dropped: made again, exactly (it used to
  loop forever on the session that no longer held them)."""
  sessions = StreamSessions(64 << 20)
  _read(sessions, big, grains, 0, 5)
  done = threading.Event()
  again: list = []

  def retry() -> None:
    again.extend(_read(sessions, big, grains, 0, 5))
    done.set()

  threading.Thread(target=retry, daemon=True).start()
  assert done.wait(_JOIN_S), "a chunk read again never came"
  assert [m for _, m in again] == [True] * 5


def test_a_long_request_with_a_host_missing_stays_within_the_budget(big, grains):
  """Host 1 of 2 never comes: what host 0 passed waits for it only while the
  budget has room (one request of 100 steps kept them all)."""
  budget = 8 * _batch_bytes(grains)
  sessions = StreamSessions(budget)
  peak = 0
  for _ in sessions.batches(big, G, big.info.stream_start, 100, (2, 0)):
    peak = max(peak, sessions.nbytes)
  assert peak <= budget + _batch_bytes(grains) + big.iterator_bytes(G)
  assert sessions.evictions > 0


def test_with_no_budget_a_lone_reader_keeps_only_its_iterator(big, grains):
  """Embedded mode's case (a budget of 0): the stream goes on from one live
  iterator, no batch is kept, and nothing is replayed."""
  sessions = StreamSessions(0)
  made = [m for k in range(0, 40, 4) for _, m in _read(sessions, big, grains, k, 4)]
  assert all(made) and len(sessions) == 1
  assert sessions.nbytes == big.iterator_bytes(G) + 128


def test_sessions_are_capped_by_count_and_evicted_ones_still_read_exactly(big, grains):
  sessions = StreamSessions(1 << 30, max_sessions=8)
  for k in range(0, 60, 2):  # 30 positions, one host each: 30 sessions
    _read(sessions, big, grains, k, 1, host=(2, 0))
  assert len(sessions) <= 8 and sessions.evictions >= 22
  for k in range(0, 60, 2):  # the other hosts: their batches are made again where evicted
    _read(sessions, big, grains, k, 1, host=(2, 1))
  assert len(sessions) <= 8


def test_a_refused_position_leaves_nothing(big, grains):
  sessions = StreamSessions(64 << 20)
  start = json.loads(big.info.stream_start)
  for i in range(50):
    bad = stream_lib.dumps({**start, "next_index": 10**19 + i})  # past the stream: Grain refuses
    with pytest.raises(InvalidRequestError, match="not a position of this stream"):
      list(sessions.batches(big, G, bad, 1, (1, 0)))
  assert len(sessions) == 0 and sessions.nbytes == 0
  _read(sessions, big, grains, 0, 2)


def test_a_production_that_fails_drops_its_session(big, grains, monkeypatch):
  sessions = StreamSessions(64 << 20)
  _read(sessions, big, grains, 0, 2, host=(2, 0))
  real = big.next_batch
  monkeypatch.setattr(big, "next_batch", lambda *a: (_ for _ in ()).throw(OSError("disk")))
  with pytest.raises(OSError, match="disk"):
    list(sessions.batches(big, G, _position(big, grains, 2), 2, (2, 0)))
  monkeypatch.setattr(big, "next_batch", real)
  assert all(s.key[1] != _position(big, grains, 2) for s in sessions._sessions.values())
  _read(sessions, big, grains, 2, 2, host=(2, 0))


def test_a_cancelled_production_stops_inside_its_batch(big, grains):
  """The request goes away while a batch of 4,096 rows is being made: the
  head stops within an element, and the next reader still gets Grain's batches."""
  sessions = StreamSessions(64 << 20)
  g = 4096
  calls = [0]

  def is_active() -> bool:
    calls[0] += 1
    return calls[0] < 50

  with pytest.raises(Cancelled):
    list(sessions.batches(big, g, big.info.stream_start, 1, (1, 0), is_active))
  assert calls[0] == 50  # one check per element: it stopped at once, not at G
  it = iter(big.pipeline(g))
  want = next(it)
  ((leaves, _), _), = sessions.batches(big, g, big.info.stream_start, 1, (1, 0))
  for a, key in zip(leaves, sorted(want)):
    assert a.tobytes() == want[key].tobytes()


def test_many_readers_at_once_get_grains_batches_within_the_bounds(big, grains):
  """Threads reading random chunks as random hosts of random jobs, under a
  budget of a few batches and a small count: all exact, nothing stuck."""
  budget = 6 * _batch_bytes(grains)
  sessions = StreamSessions(budget, max_sessions=6)
  errors: list[BaseException] = []
  peak = [0]

  def reader(seed: int) -> None:
    rng = random.Random(seed)
    try:
      for _ in range(15):
        first = rng.randrange(0, 100, 4)
        hosts = rng.choice([1, 2, 4])
        _read(sessions, big, grains, first, rng.randint(1, 8), host=(hosts, rng.randrange(hosts)))
        peak[0] = max(peak[0], len(sessions))
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(_JOIN_S)
  assert not any(t.is_alive() for t in threads), "a reader is stuck"
  assert not errors, errors
  assert peak[0] <= 6
  assert sessions.nbytes <= budget + 6 * (big.iterator_bytes(G) + 4 * 128)


def test_the_position_check_refuses_what_has_not_the_streams_shape(big):
  start = big.info.stream_start
  parsed = json.loads(start)
  for bad, why in [
      ("x" * 20000, "over the"), ("[1]", "JSON object"), ("{", "not JSON"),
      (stream_lib.dumps({**parsed, "evil": 1}), "it has others"),
      (stream_lib.dumps({**parsed, "next_index": -1}), "whole number"),
      (stream_lib.dumps({**parsed, "next_index": 1.5}), "whole number"),
      (stream_lib.dumps({**parsed, "next_index": "3"}), "whole number"),
      (stream_lib.dumps({}), "missing")]:
    with pytest.raises(InvalidRequestError, match=why) as e:
      stream_lib.parse_position(bad, start, "big")
    assert "evil" not in str(e.value)  # a client's own keys are not echoed
  assert stream_lib.parse_position(start, start, "big") == start


def test_a_position_grain_reads_back_otherwise_is_refused(big):
  """Shape alone cannot tell; Grain's own set_state, read back, can."""
  start = json.loads(big.info.stream_start)
  with pytest.raises(InvalidRequestError, match="not a position of this stream"):
    big.open(G, stream_lib.dumps({**start, "next_index": 10**19}))
