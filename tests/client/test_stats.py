"""`RemoteDataset.stats()`: how long the trainer waited for data, against a
real server, and the periodic log line."""

from __future__ import annotations

import logging
import time

import numpy as np

from grain_elevator.client import RemoteDataset, Stats


def test_stats_count_steps_bytes_and_the_wait(server):
  with RemoteDataset(server.target, "plain", 100, prefetch=2, stats_log_s=0) as ds:
    assert ds.stats() == Stats()
    it = iter(ds)
    got, step_s = 0, None
    for _ in range(5):
      batch = next(it)
      got += sum(np.asarray(v).nbytes for v in batch.values())
      # A trainer step: the next batch arrives meanwhile. It is 0.2 s, or twice
      # the first fetch (connecting included) where a loaded machine made that
      # slower, so that computing outweighs waiting whatever the machine.
      step_s = step_s or max(0.2, 2 * it.stats().wait_s)
      time.sleep(step_s)
    s = it.stats()
    assert s.steps == 5 and s.bytes == got
    assert s.wall_s >= 0.8 and 0 < s.wait_s < s.wall_s
    # Five steps with two in flight: the trainer mostly computes.
    assert s.wait_ratio < 0.5
    assert s.bytes_per_s == s.bytes / s.wall_s
    assert s.retries == 0 and s.fallbacks == 0
    assert ds.stats().steps == 5
    assert "5 steps in" in s.line() and "waited" in s.line()


def test_a_trainer_that_never_computes_waits_most_of_the_time(server):
  with RemoteDataset(server.target, "plain", 100, prefetch=0, stats_log_s=0) as ds:
    it = iter(ds)
    for _ in it:  # prefetch 0: every step is fetched while the trainer waits
      pass
    s = it.stats()
  assert s.steps == 10 and s.wait_ratio > 0.5


def test_the_summary_is_logged_periodically(server, caplog):
  caplog.set_level(logging.INFO, logger="grain_elevator.client")
  with RemoteDataset(server.target, "plain", 100, stats_log_s=0.05) as ds:
    for _ in ds:
      time.sleep(0.03)
  lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
  assert lines and "plain" in lines[0] and "steps in" in lines[0]


def test_stats_add_up():
  a = Stats(1, 10, 1.0, 0.5, 1, 0)
  assert a + a == Stats(2, 20, 2.0, 1.0, 2, 0)
  assert (a + a).wait_ratio == 0.5 and Stats().wait_ratio == 0.0


def test_the_trainers_metrics_port_serves_every_iterators_stats(server):
  import urllib.request  # pylint: disable=g-import-not-at-top
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import start_metrics_server  # pylint: disable=g-import-not-at-top
  port = start_metrics_server(0)
  with RemoteDataset(server.target, "plain", 100, stats_log_s=0) as ds:
    it = iter(ds)
    for _ in range(4):
      next(it)
    s = it.stats()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
      text = r.read().decode()
  samples = {(x.name, x.labels.get("dataset")): x.value
             for f in text_string_to_metric_families(text) for x in f.samples}
  assert samples[("elevator_client_steps_total", "plain")] >= 4
  assert samples[("elevator_client_bytes_total", "plain")] >= s.bytes
  assert 0 <= samples[("elevator_client_wait_ratio", "plain")] <= 1
  assert samples[("elevator_client_fallbacks_total", "plain")] == 0
