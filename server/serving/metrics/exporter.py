"""The supervisor's side: the workers' samples summed into one scrape.

The supervisor makes the multiprocess folder its workers record into
(recorder.py) and serves `/metrics` (`--metrics-port`, scrape.py), where
prometheus_client sums every worker's files. A dead worker's counter files
stay, so counters survive restarts and never decrease; its live gauges are
dropped when the supervisor notes its death. The supervisor adds its own
metrics (catalog.py: workers, restarts, utilization).

Utilization is measured from the workers' CPU time (/proc), not from request
timing, so it counts whatever a worker spends (decode, copies, sends) and
nothing it waits for; it is the signal to scale the data tier on.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

from grain_elevator.server.serving.metrics import catalog
from grain_elevator.server.serving.metrics import recorder
from grain_elevator.server.serving.metrics import scrape

_SAMPLE_EVERY_S = 1.0


def _cpu_seconds(pid: int) -> float | None:
  """utime + stime of a live process, from /proc; None once it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return None


class Exporter:
  """The supervisor's side: the multiprocess folder, the CPU sampler behind
  utilization, and the HTTP endpoint."""

  def __init__(self, worker_pids: Callable[[], list[int]], num_workers: int, *,
               scrape_timeout_s: float = scrape.SCRAPE_TIMEOUT_S,
               max_scrapes: int = scrape.MAX_SCRAPE_CONNECTIONS):
    self.folder = tempfile.mkdtemp(prefix="elevator-metrics-")
    self._worker_pids = worker_pids
    self._num_workers = num_workers
    self._restarts = 0
    self._cpu_of: dict[int, float] = {}  # live pid -> CPU seconds at its last sample
    self._cpu_gone = 0.0  # CPU seconds of workers that have died
    self._samples: collections.deque[tuple[float, float]] = collections.deque()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._scrape_timeout_s = scrape_timeout_s
    self._max_scrapes = max_scrapes
    self._http: scrape.ScrapeServer | None = None
    self.port: int | None = None

  # -- what workers need ------------------------------------------------------

  def worker_env(self) -> dict[str, str]:
    return {recorder.ENV: self.folder}

  def worker_died(self, pid: int | None) -> None:
    """Drops a dead worker's live gauges; its counters stay."""
    from prometheus_client import multiprocess  # pylint: disable=g-import-not-at-top
    with self._lock:
      self._restarts += 1
      if pid is not None:
        self._cpu_gone += self._cpu_of.pop(pid, 0.0)
    if pid is not None:
      multiprocess.mark_process_dead(pid, self.folder)

  # -- utilization ------------------------------------------------------------

  def _sample(self) -> None:
    now = time.monotonic()
    with self._lock:
      for pid in self._worker_pids():
        cpu = _cpu_seconds(pid)
        if cpu is not None:
          self._cpu_of[pid] = cpu
      total = self._cpu_gone + sum(self._cpu_of.values())
      self._samples.append((now, total))
      while len(self._samples) > 2 and now - self._samples[1][0] >= catalog.UTILIZATION_WINDOW_S:
        self._samples.popleft()

  def utilization(self) -> float:
    """Busy fraction of the workers' capacity over the sampled window."""
    with self._lock:
      if len(self._samples) < 2:
        return 0.0
      (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
    if t1 <= t0:
      return 0.0
    return min(1.0, max(0.0, (c1 - c0) / ((t1 - t0) * self._num_workers)))

  def _sampler(self) -> None:
    while not self._stop.wait(_SAMPLE_EVERY_S):
      self._sample()

  # -- the endpoint -----------------------------------------------------------

  def collect(self) -> Iterator[Any]:
    """The supervisor's own metrics (a prometheus_client collector)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # pylint: disable=g-import-not-at-top
    yield GaugeMetricFamily(catalog.WORKERS.name, catalog.WORKERS.help,
                            value=len(self._worker_pids()))
    yield CounterMetricFamily(catalog.WORKER_RESTARTS.name, catalog.WORKER_RESTARTS.help,
                              value=self._restarts)
    yield GaugeMetricFamily(catalog.UTILIZATION.name, catalog.UTILIZATION.help,
                            value=self.utilization())

  def start(self, host: str, port: int) -> int:
    """Serves /metrics on host:port (0: a free port); returns the port."""
    import prometheus_client as prom  # pylint: disable=g-import-not-at-top
    from prometheus_client import multiprocess  # pylint: disable=g-import-not-at-top
    registry = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=self.folder)
    registry.register(self)
    self._sample()
    threading.Thread(target=self._sampler, daemon=True, name="elevator-metrics").start()
    self._http = scrape.serve(host, port, prom.make_wsgi_app(registry),
                              timeout_s=self._scrape_timeout_s,
                              max_connections=self._max_scrapes)
    self.port = self._http.server_port
    return self.port

  def stop(self) -> None:
    self._stop.set()
    if self._http is not None:
      self._http.shutdown()
      self._http.server_close()
    shutil.rmtree(self.folder, ignore_errors=True)
