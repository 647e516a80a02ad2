"""`--metrics-port`: one Prometheus scrape for the whole server, whose counters
match what clients received and survive a worker restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, TransportOptions, UnknownDatasetError
from grain_elevator.server import ConfigError, Server, ServerOptions, metrics, supervisor
from grain_elevator.tools import top
from grain_elevator.tools.launcher import ELEVATOR


def scrape(server: Server) -> top.Samples:
  """{(sample name, sorted labels): value} of one scrape of /metrics."""
  return top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=10)


def read_all(server: Server, dataset: str, g: int, kind: str) -> int:
  """Reads the whole (finite) stream; returns the bytes of its arrays."""
  total = 0
  with RemoteDataset(server.target, dataset, g, transport=TransportOptions(kind=kind)) as ds:
    for batch in ds:
      total += sum(np.asarray(leaf).nbytes for leaf in batch.values())
  return total


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.1)


def test_counters_match_what_clients_received_across_a_worker_restart(config_path):
  # "plain": 1,000 records, no shuffle, 1 epoch: G=100 is exactly 10 steps.
  with Server(config_path, ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    assert f"metrics at http://127.0.0.1:{server.metrics_port}/metrics" in (
        supervisor.ready_line(server))
    m = scrape(server)
    assert m[("elevator_workers", ())] == 2
    assert m.get(("elevator_batches_total", (("dataset", "plain"),)), 0) == 0

    bulk_bytes = read_all(server, "plain", 100, "bulk")
    grpc_bytes = read_all(server, "plain", 100, "grpc")
    with pytest.raises(UnknownDatasetError):
      read_all(server, "no-such-dataset", 100, "grpc")
    m = scrape(server)
    assert m[("elevator_batches_total", (("dataset", "plain"),))] == 20
    # The gRPC reader asked for the steps the bulk one had: served from the
    # workers' batch caches, produced once.
    assert m[("elevator_batch_seconds_count", (("dataset", "plain"),))] == 10
    assert m[("elevator_batch_cache_hits_total", (("dataset", "plain"),))] == 10
    assert m[("elevator_batch_cache_bytes", ())] > 0
    for transport, got in (("bulk", bulk_bytes), ("grpc", grpc_bytes)):
      sent = m[("elevator_bytes_sent_total", (("dataset", "plain"), ("transport", transport)))]
      # The arrays, plus each step's framing and leaf headers (tens of bytes).
      assert got <= sent <= got + 10 * 512, transport
    assert m[("elevator_request_errors_total", (("code", "NOT_FOUND"),))] >= 1
    # A request leaves the gauge just after its client got the last step.
    wait_for(lambda: scrape(server)[("elevator_inflight_requests", ())] == 0,
             "the requests to end")
    assert m[("elevator_worker_restarts_total", ())] == 0
    assert 0 <= m[("elevator_utilization", ())] <= 1

    victim = server.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in server.worker_pids() and len(server.worker_pids()) == 2,
             "the worker's restart")
    m = scrape(server)
    # Counters kept what the dead worker counted, and never went down.
    assert m[("elevator_batches_total", (("dataset", "plain"),))] == 20
    assert m[("elevator_worker_restarts_total", ())] == 1
    assert m[("elevator_workers", ())] == 2
    read_all(server, "plain", 100, "bulk")
    m = scrape(server)
    assert m[("elevator_batches_total", (("dataset", "plain"),))] == 30
    # The restarted worker's cache started empty, the other's kept its steps.
    assert (m[("elevator_batch_seconds_count", (("dataset", "plain"),))]
            + m[("elevator_batch_cache_hits_total", (("dataset", "plain"),))]) == 30
    # A request leaves the gauge just after its client got the last step.
    wait_for(lambda: scrape(server)[("elevator_inflight_requests", ())] == 0,
             "the requests to end")
  with pytest.raises(OSError):  # the endpoint went with the server
    urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=2)


def test_no_metrics_port_means_no_endpoint_and_no_recording(config_path):
  with Server(config_path, ServerOptions(port=0, workers=1)) as server:
    assert server.metrics_port is None
    assert "metrics" not in supervisor.ready_line(server)
    assert isinstance(metrics.current(), metrics._Off)  # pylint: disable=protected-access
    assert metrics.ENV not in os.environ


def test_a_bad_metrics_port_is_refused():
  with pytest.raises(ConfigError, match="metrics_port"):
    ServerOptions(metrics_port=70000)


def _child(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("busy", [True, False])
def test_utilization_is_the_workers_cpu_share(busy):
  """A process spinning counts as a busy worker, one sleeping as an idle one."""
  proc = _child("while True: pass" if busy else "import time; time.sleep(60)")
  exporter = metrics.Exporter(lambda: [proc.pid], num_workers=1)
  try:
    exporter._sample()  # pylint: disable=protected-access
    time.sleep(2.0)
    exporter._sample()  # pylint: disable=protected-access
    u = exporter.utilization()
    # A spinning process gets most of a core even on a busy 2-core machine.
    assert (u > 0.4) if busy else (u < 0.1), u
  finally:
    proc.kill()
    proc.wait()
    exporter.stop()


def test_elevator_top_shows_rates_of_a_live_server(config_path):
  with Server(config_path, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
    address = f"127.0.0.1:{server.metrics_port}"
    top = subprocess.Popen([*ELEVATOR, "top", address, "--once", "--interval", "3"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # its first scrape is taken; the stream falls between the two
    read_all(server, "plain", 100, "bulk")
    out, err = top.communicate(timeout=60)
  assert top.returncode == 0, err
  assert "workers 1" in out and "utilization" in out
  assert re.search(r"dataset plain: [\d.]+ batches/s   batch time p50 ≤ [\d.]+ ms", out), out
  assert re.search(r"sent plain/bulk: [\d.]+ MB/s", out), out


def test_elevator_top_names_a_server_without_metrics():
  result = subprocess.run([*ELEVATOR, "top", "127.0.0.1:1", "--once"], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 2 and "is the server run with --metrics-port" in result.stderr
