"""How deep a worker reads, in-process with a clock the test moves: the
depth Little's law asks for from measured latency and rate, the per-prefix
window a refusing store narrows (AIMD), and the gate that enforces both."""

from __future__ import annotations

import asyncio

import pytest

from grain_elevator.server.data.storage import latency as latency_lib
from grain_elevator.server.data.storage import throttle


class _Clock:
  def __init__(self) -> None:
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
  c = _Clock()
  monkeypatch.setattr(latency_lib.time, "monotonic", c)
  monkeypatch.setattr(throttle.time, "monotonic", c)
  return c


def test_depth_is_the_rate_asked_times_the_p99_twice_over(clock):
  lat = latency_lib.Latency()
  assert lat.depth(16, 4096) == 16  # nothing asked yet: the floor
  for i in range(1000):  # p99 of these: 0.5 s
    lat.record(0.5 if i % 50 == 0 else 0.02, 100_000)
  lat.record(30.0, 8 << 20)  # a cache fill's time is its transfer: not a sample
  for _ in range(10):  # 2,000 reads a second, for a few windows
    clock.now += latency_lib.RATE_WINDOW_S
    lat.asked(2000)
  assert lat.rate == pytest.approx(2000, rel=0.01)
  clock.now += latency_lib.REFRESH_S
  assert 0.49 <= lat.quantile(99) <= 0.5
  assert lat.depth(16, 4096) == pytest.approx(2 * 2000 * lat.quantile(99), rel=0.01)
  assert lat.depth(16, 1000) == 1000  # the ceiling
  assert lat.horizon_s() == pytest.approx(2 * lat.quantile(99) + lat.quantile(95))


def test_a_refusing_store_halves_the_prefix_window_once_a_round_trip(clock):
  prefix = throttle.Prefix()
  assert prefix.window == float("inf")
  prefix.gate.held = 64  # reads in flight when the store refuses
  prefix.refused()
  assert prefix.window == 32
  prefix.refused()  # the same round trip's other refusals: one cut
  assert prefix.window == 32
  clock.now += throttle.CUT_INTERVAL_S
  prefix.refused()
  assert prefix.window == 16
  for _ in range(16):  # a window's worth of answers: one more request
    prefix.answered(unlimited_above=1000)
  assert prefix.window == pytest.approx(17, abs=0.05)
  for _ in range(20):
    clock.now += throttle.CUT_INTERVAL_S
    prefix.refused()
  assert prefix.window == throttle.MIN_WINDOW
  prefix.answered(unlimited_above=throttle.MIN_WINDOW)  # past the worker's own depth: lifted
  assert prefix.window == float("inf")


def test_the_gate_admits_to_its_limit_and_wakes_waiters_when_it_moves():
  async def run() -> None:
    gate = throttle.Gate(2)
    await gate.acquire()
    await gate.acquire()
    waiting = [asyncio.ensure_future(gate.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting) and gate.held == 2
    waiting[0].cancel()  # gives up before a slot: takes none
    gate.set_limit(3)
    await asyncio.sleep(0)
    assert waiting[1].done() and not waiting[2].done() and gate.held == 3
    gate.release()
    await asyncio.sleep(0)
    assert waiting[2].done() and gate.held == 3
  asyncio.run(run())
