"""`--metrics-port`: one Prometheus scrape for the whole server, whose counters
match what clients received and survive a worker restart."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, TransportOptions, UnknownDatasetError
from grain_elevator.server import ConfigError, Server, ServerOptions
from grain_elevator.server.process import supervisor
from grain_elevator.server.serving import metrics
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


# The endpoint under slow peers: each holds a thread for a bounded time, and
# only a bounded number of them at once.

HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: elevator\r\n"  # no blank line: not done


def _half_sent(port: int, n: int, stack: contextlib.ExitStack) -> list[socket.socket]:
  socks = []
  for _ in range(n):
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
    sock.sendall(HALF_A_REQUEST)
    socks.append(sock)
  return socks


def _closed_by_server(sock: socket.socket) -> bool:
  try:
    return sock.recv(1) == b""
  except ConnectionResetError:
    return True


def test_half_sent_scrapes_hold_bounded_threads_and_a_scrape_still_answers(config_path):
  import psutil  # pylint: disable=import-outside-toplevel
  me = psutil.Process()
  with Server(config_path, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
    scrape(server)
    before = me.num_threads()
    with contextlib.ExitStack() as stack:
      _half_sent(server.metrics_port, 100, stack)
      time.sleep(1.0)  # every one accepted, each thread blocked in its read
      threads = me.num_threads()
      began = time.monotonic()
      m = scrape(server)  # closes the peer that has waited longest
      took = time.monotonic() - began
  assert threads <= before + metrics.MAX_SCRAPE_CONNECTIONS + 2, (before, threads)
  assert m[("elevator_workers", ())] == 1 and took < 5, took


def test_a_half_sent_scrape_is_closed_after_the_timeout():
  exporter = metrics.Exporter(lambda: [], num_workers=1, scrape_timeout_s=1.0, max_scrapes=4)
  try:
    port = exporter.start("127.0.0.1", 0)
    with contextlib.ExitStack() as stack:
      socks = _half_sent(port, 3, stack)
      began = time.monotonic()
      assert all(_closed_by_server(s) for s in socks)
      assert 0.5 < time.monotonic() - began < 8
      # Beyond the limit a newcomer closes the peer that has waited longest,
      # at once; a scrape at the limit is answered the same way.
      oldest = _half_sent(port, 5, stack)[0]
      oldest.settimeout(0.5)  # well before the timeout
      assert _closed_by_server(oldest)
      m = top.scrape(f"127.0.0.1:{port}", timeout_s=0.5)
      assert m[("elevator_workers", ())] == 0
  finally:
    exporter.stop()
