"""`--metrics-port`: one Prometheus scrape for the whole server, whose counters
match what clients received and survive a worker restart."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
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
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import cpu_s, wait_for


def scrape(server: Server) -> top.Samples:
  """{(sample name, sorted labels): value} of one scrape of /metrics."""
  return top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=60)


STEPS_PER_REQUEST = 4


def read_all(server: Server, dataset: str, g: int, kind: str) -> int:
  """Reads the whole (finite) stream; returns the bytes of its arrays. Every
  reader asks for the same chunks (a default client's size follows the
  times it is told, which two readers may hear differently: client/request_size.py)."""
  total = 0
  with RemoteDataset(server.target, dataset, g, transport=TransportOptions(
      kind=kind, steps_per_request=STEPS_PER_REQUEST)) as ds:
    for batch in ds:
      total += sum(np.asarray(leaf).nbytes for leaf in batch.values())
  return total


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
    # A request leaves the gauge just after its client got the last step, and
    # the bulk transport counts a batch's bytes once they are sent: scraped
    # once the requests have ended, the counters hold all they did.
    wait_for(lambda: scrape(server)[("elevator_inflight_requests", ())] == 0,
             "the requests to end")
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
    assert m[("elevator_worker_restarts_total", ())] == 0
    assert 0 <= m[("elevator_utilization", ())] <= 1

    victim = server.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in server.worker_pids() and len(server.worker_pids()) == 2,
             "the worker's restart", 120)
    m = scrape(server)
    # Counters kept what the dead worker counted, and never went down.
    assert m[("elevator_batches_total", (("dataset", "plain"),))] == 20
    assert m[("elevator_worker_restarts_total", ())] == 1
    assert m[("elevator_workers", ())] == 2
    read_all(server, "plain", 100, "bulk")
    wait_for(lambda: scrape(server)[("elevator_inflight_requests", ())] == 0,
             "the requests to end")
    m = scrape(server)
    assert m[("elevator_batches_total", (("dataset", "plain"),))] == 30
    # The restarted worker's cache started empty, the other's kept its steps.
    assert (m[("elevator_batch_seconds_count", (("dataset", "plain"),))]
            + m[("elevator_batch_cache_hits_total", (("dataset", "plain"),))]) == 30
  with pytest.raises(OSError):  # the endpoint went with the server
    urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=2)


def test_no_metrics_port_means_no_endpoint_and_no_recording(serve):
  server = serve(workers=1)  # the session's: this test only reads
  assert server.metrics_port is None
  assert "metrics" not in supervisor.ready_line(server)
  assert not metrics.current().on
  assert metrics.ENV not in os.environ


def test_a_bad_metrics_port_is_refused():
  with pytest.raises(ConfigError, match="metrics_port"):
    ServerOptions(metrics_port=70000)


def _child(code: str) -> subprocess.Popen:
  """A Python child running `code` once it has started (its start-up, which
  a loaded machine makes slow, is over when this returns)."""
  proc = subprocess.Popen([sys.executable, "-c", f"print('ready', flush=True)\n{code}"],
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "ready\n"
  return proc


@pytest.mark.parametrize("busy", [True, False])
def test_utilization_is_the_workers_cpu_share(busy):
  """A process spinning counts as a busy worker, one sleeping as an idle one:
  utilization is the share of a core the kernel gave it, which this test
  measures too, so a loaded machine changes the figure but not the check."""
  import psutil  # pylint: disable=import-outside-toplevel
  proc = _child("while True: pass" if busy else "import time; time.sleep(600)")
  child = psutil.Process(proc.pid)
  exporter = metrics.Exporter(lambda: [proc.pid], num_workers=1)
  try:
    cpu, began = cpu_s(child), time.monotonic()
    exporter._sample()  # pylint: disable=protected-access
    if busy:  # a window holding a CPU-second of spinning, however long that takes
      wait_for(lambda: cpu_s(child) - cpu >= 1.0, "the child to spin for a CPU-second")
    else:
      time.sleep(2.0)
    exporter._sample()  # pylint: disable=protected-access
    share = (cpu_s(child) - cpu) / (time.monotonic() - began)
    u = exporter.utilization()
    assert u == pytest.approx(share, abs=0.05), (u, share)
    if not busy:
      assert u < 0.1, u
  finally:
    proc.kill()
    proc.wait()
    exporter.stop()


def test_elevator_top_shows_rates_of_a_live_server(serve):
  server = serve(workers=1, metrics_port=0)  # the session's: rates are read, not counts
  address = f"127.0.0.1:{server.metrics_port}"
  top = subprocess.Popen([*ELEVATOR, "top", address, "--once", "--interval", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  # Streaming until top is done, so the stream spans its two scrapes
  # whenever its start-up lets it take them: new steps all along.
  with RemoteDataset(server.target, "forever", 100,
                     transport=TransportOptions(kind="bulk")) as ds:
    deadline = time.monotonic() + 120
    for _ in ds:
      if top.poll() is not None:
        break
      assert time.monotonic() < deadline, "elevator top did not finish"
  out, err = top.communicate(timeout=60)
  assert top.returncode == 0, err
  assert "workers 1" in out and "utilization" in out
  assert re.search(r"dataset forever: [\d.]+ batches/s   batch time p50 ≤ [\d.]+ ms", out), out
  assert re.search(r"sent forever/bulk: [\d.]+ MB/s", out), out


def test_elevator_top_names_a_server_without_metrics(elevator):
  code, _, err = elevator("top", "127.0.0.1:1", "--once")
  assert code == 2 and "is the server run with --metrics-port" in err


# The endpoint under slow peers: each holds a thread for a bounded time, and
# only a bounded number of them at once.

HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: elevator\r\n"  # no blank line: not done


def _half_sent(port: int, n: int, stack: contextlib.ExitStack) -> list[socket.socket]:
  socks = []
  for _ in range(n):
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=60))
    sock.sendall(HALF_A_REQUEST)
    socks.append(sock)
  return socks


def _closed_by_server(sock: socket.socket) -> bool:
  """Waits (up to the socket's timeout) for the server to hang up."""
  try:
    return sock.recv(1) == b""
  except ConnectionResetError:
    return True


def _hung_up_now(sock: socket.socket) -> bool:
  """Whether the server has hung up on `sock` (which it never answers)."""
  return bool(select.select([sock], [], [], 0)[0]) and _closed_by_server(sock)


def test_half_sent_scrapes_hold_bounded_threads_and_a_scrape_still_answers(config_path,
                                                                           monkeypatch):
  import psutil  # pylint: disable=import-outside-toplevel
  # The server's endpoint with a scrape timeout of 10 minutes, not 10 s: only
  # the bound on connections can close a half-sent peer during the test, and
  # a scrape that had to wait for a slot would wait that long.
  monkeypatch.setattr(metrics, "Exporter",
                      functools.partial(metrics.Exporter, scrape_timeout_s=600))
  me = psutil.Process()
  with Server(config_path, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
    scrape(server)
    before = me.num_threads()
    with contextlib.ExitStack() as stack:
      socks = _half_sent(server.metrics_port, 100, stack)
      # Each newcomer past the bound closed the one that had waited longest.
      dropped = 100 - metrics.MAX_SCRAPE_CONNECTIONS
      wait_for(lambda: sum(map(_hung_up_now, socks[:dropped])) == dropped,
               "the server to take every connection")
      assert not any(map(_hung_up_now, socks[dropped:]))
      # Their threads end as they are hung up; those of the others wait on.
      wait_for(lambda: me.num_threads() <= before + metrics.MAX_SCRAPE_CONNECTIONS + 2,
               f"threads to come down to the bound (now {me.num_threads()}, before {before})")
      m = scrape(server)  # closes the peer that has waited longest, and is answered
  assert m[("elevator_workers", ())] == 1


def test_a_half_sent_scrape_is_closed_after_the_timeout():
  exporter = metrics.Exporter(lambda: [], num_workers=1, scrape_timeout_s=1.0, max_scrapes=4)
  try:
    port = exporter.start("127.0.0.1", 0)
    with contextlib.ExitStack() as stack:
      began = time.monotonic()
      socks = _half_sent(port, 3, stack)
      assert all(_closed_by_server(s) for s in socks)
      # After its 1 s, and well before the default SCRAPE_TIMEOUT_S (10 s).
      assert 0.5 < time.monotonic() - began < metrics.SCRAPE_TIMEOUT_S
  finally:
    exporter.stop()


def test_past_the_bound_the_longest_waiting_half_sent_scrape_is_closed_at_once():
  """Beyond the limit a newcomer closes the peer that has waited longest,
  at once; a scrape at the limit is answered the same way. (The scrape
  timeout is 10 minutes: nothing else closes a peer here.)"""
  exporter = metrics.Exporter(lambda: [], num_workers=1, scrape_timeout_s=600, max_scrapes=4)
  try:
    port = exporter.start("127.0.0.1", 0)
    with contextlib.ExitStack() as stack:
      oldest = _half_sent(port, 5, stack)[0]
      assert _closed_by_server(oldest)
      m = top.scrape(f"127.0.0.1:{port}", timeout_s=60)
      assert m[("elevator_workers", ())] == 0
  finally:
    exporter.stop()


_SCRAPE_ONE_OF_EACH = """
import os, urllib.request
from grain_elevator.server.serving import metrics
exporter = metrics.Exporter(lambda: [], 1)
os.environ[metrics.ENV] = exporter.folder
metrics.start_recording()
r = metrics.current()
r.records_served("d", "c", 1); r.tokens_served("d", "c", 1); r.produced("d", 0.01)
r.served("d", cached=True); r.cache_bytes(1); r.sent("d", "bulk", 1); r.error("NOT_FOUND")
r.inflight(1); r.stream_sessions(1, 1); r.stream_session_evicted(); r.head_task(0, 1)
r.head_fallback(0, 1); r.storage_bytes("d", fetched=1, needed=1, planned=True)
r.storage_request(0.1); r.read_ahead_bytes(1); r.storage_get("d", "answered")
r.cache_read("d", hit_bytes=1, miss_bytes=1); r.cache_filled("d", 1); r.object_cache_bytes(1, 2)
port = exporter.start("127.0.0.1", 0)
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode())
exporter.stop()
"""


def test_a_scrape_has_every_metric_of_the_catalog_and_no_other():
  """The catalog is the one list: what a worker and the supervisor export
  is made from it, with its help."""
  from grain_elevator.server.serving.metrics import catalog  # pylint: disable=import-outside-toplevel
  text = subprocess.run([sys.executable, "-c", _SCRAPE_ONE_OF_EACH], capture_output=True,
                        text=True, timeout=120, check=True).stdout
  helps = dict(re.findall(r"^# HELP (elevator_\w+) (.*)$", text, re.MULTILINE))
  kinds = dict(re.findall(r"^# TYPE (elevator_\w+) (\w+)$", text, re.MULTILINE))
  assert helps == {m.scraped_name: m.help for m in catalog.METRICS}
  assert kinds == {m.scraped_name: m.kind for m in catalog.METRICS}
