"""Prometheus metrics: every worker records its own, the supervisor serves one scrape.

Workers are separate processes that come and go (restarts), so they use
prometheus_client's multiprocess mode: each writes its samples to files of
its own in a folder the supervisor creates and names in
PROMETHEUS_MULTIPROC_DIR before spawning it. The supervisor's `/metrics`
(`--metrics-port`) sums them. A dead worker's counter files stay, so counters
survive restarts and never decrease; its live gauges are dropped when the
supervisor notes its death.

Workers record (labels in braces):
  elevator_batches_total{dataset}             steps served (produced or cached)
  elevator_batch_cache_hits_total{dataset}     of those, steps served from the cache of
                                               steps shared between trainers
  elevator_bytes_sent_total{dataset,transport} batch bytes handed to the socket
  elevator_request_errors_total{code}          requests answered with an error status
  elevator_batch_seconds{dataset}              histogram: time to produce one step
  elevator_inflight_requests                   admitted requests, all workers
  elevator_batch_cache_bytes                   bytes the workers' caches hold
  elevator_stream_sessions                     stream sessions the workers hold
                                               (server/serving/stream_sessions.py)
  elevator_stream_session_bytes                their global batches and live iterators
  elevator_stream_session_evictions_total      sessions (or their batches) evicted
                                               to stay within the budget
  elevator_head_tasks_total{owner,worker}      tasks of a stream's head (parallel_head.py)
                                               of worker `owner`'s streams, computed by
                                               worker `worker` (indices; owner == worker:
                                               by the owner itself)
  elevator_head_fallbacks_total{owner,worker}  of the tasks `owner` dealt to `worker`,
                                               those it computed itself: that worker
                                               died, hung or failed them
  elevator_storage_fetched_bytes_total{dataset,planned}
                                               bytes read from buckets: planned ahead
                                               (server/serving/read_plan.py) or by the
                                               step that needed them
  elevator_storage_needed_bytes_total{dataset} bytes of the chunks steps needed; fetched
                                               over needed is the read amplification
  elevator_storage_request_seconds             histogram: one ranged read, its retries
                                               included (server/data/storage/objects.py)
  elevator_read_ahead_bytes                    bytes the workers' read-ahead holds

The supervisor adds:
  elevator_workers                             live worker processes
  elevator_worker_restarts_total               workers restarted after dying
  elevator_utilization                         busy fraction of the workers' capacity
                                               over the last UTILIZATION_WINDOW_S: their
                                               CPU seconds / (seconds x workers), in [0, 1]

Utilization is measured from the workers' CPU time (/proc), not from request
timing, so it counts whatever a worker spends (decode, copies, sends) and
nothing it waits for; it is the signal to scale the data tier on.
Without `--metrics-port` (and in embedded mode) recording is a no-op.

The endpoint answers each connection on a thread of its own, so it is
bounded like every transport: a read or write that waits SCRAPE_TIMEOUT_S
closes the connection, and at most MAX_SCRAPE_CONNECTIONS are open at once.
A newcomer beyond that closes the one that has waited longest for its
request to arrive (a peer that sends half a request yields to a scraper),
or is closed itself when every one is being answered.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from typing import Any, Callable, Iterator
from wsgiref import simple_server

log = logging.getLogger("grain_elevator.server")

ENV = "PROMETHEUS_MULTIPROC_DIR"
UTILIZATION_WINDOW_S = 30.0
# A scrape takes milliseconds; a connection whose read or write waits this
# long is closed.
SCRAPE_TIMEOUT_S = 10.0
# Prometheus scrapes a target once per interval, a few scrapers at most.
MAX_SCRAPE_CONNECTIONS = 16
_SAMPLE_EVERY_S = 1.0
# Producing a step takes ~0.1 ms (small rows) to ~1 s (big image batches).
_BATCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0)
# A bucket's ranged read: ~1 ms (a local emulator) to seconds (retries).
_STORAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class _Off:
  """What a process without metrics records: nothing, cheaply."""

  on = False  # whether what is recorded is kept (worth computing)

  def records_served(self, dataset: str, component: str, count: int) -> None:
    pass

  def tokens_served(self, dataset: str, component: str, count: int) -> None:
    pass

  def produced(self, dataset: str, seconds: float) -> None:
    pass

  def served(self, dataset: str, *, cached: bool) -> None:
    pass

  def cache_bytes(self, nbytes: int) -> None:
    pass

  def sent(self, dataset: str, transport: str, nbytes: int) -> None:
    pass

  def error(self, code: str) -> None:
    pass

  def inflight(self, delta: int) -> None:
    pass

  def stream_sessions(self, count: int, nbytes: int) -> None:
    pass

  def stream_session_evicted(self) -> None:
    pass

  def head_task(self, owner: int, worker: int) -> None:
    pass

  def head_fallback(self, owner: int, worker: int) -> None:
    pass

  def storage_bytes(self, dataset: str, *, fetched: int = 0, needed: int = 0,
                    planned: bool = False) -> None:
    pass

  def storage_request(self, seconds: float) -> None:
    pass

  def read_ahead_bytes(self, nbytes: int) -> None:
    pass


class _Recording(_Off):
  """A worker's metrics, written to its files in $PROMETHEUS_MULTIPROC_DIR."""

  on = True

  def __init__(self) -> None:
    import prometheus_client as prom  # pylint: disable=g-import-not-at-top
    self._records = prom.Counter(
        "elevator_records_served", "Records in the rows sent, by dataset and mixture "
        "component (the dataset's own name for one that is not a mixture; padding rows not "
        "counted); for a stream dataset, its rows.", ["dataset", "component"])
    self._tokens = prom.Counter(
        "elevator_tokens_served", "Tokens in the rows sent: the non-padding slots of a "
        "packed batch's segment ids (leaves named *segment_ids).", ["dataset", "component"])
    self._batches = prom.Counter("elevator_batches", "Steps served (produced or cached).",
                                 ["dataset"])
    self._hits = prom.Counter("elevator_batch_cache_hits",
                              "Steps served from the cache shared between trainers.",
                              ["dataset"])
    self._cache_bytes = prom.Gauge("elevator_batch_cache_bytes",
                                   "Bytes the workers' batch caches hold.",
                                   multiprocess_mode="livesum")
    self._bytes = prom.Counter("elevator_bytes_sent", "Batch bytes handed to the socket.",
                               ["dataset", "transport"])
    self._errors = prom.Counter("elevator_request_errors",
                                "Requests answered with an error status.", ["code"])
    self._seconds = prom.Histogram("elevator_batch_seconds", "Time to produce one step.",
                                   ["dataset"], buckets=_BATCH_BUCKETS)
    self._inflight = prom.Gauge("elevator_inflight_requests", "Admitted requests.",
                                multiprocess_mode="livesum")
    self._sessions = prom.Gauge("elevator_stream_sessions",
                                "Stream sessions the workers hold.", multiprocess_mode="livesum")
    self._session_bytes = prom.Gauge(
        "elevator_stream_session_bytes",
        "Bytes of the stream sessions' global batches and live iterators (estimated).",
        multiprocess_mode="livesum")
    self._evictions = prom.Counter(
        "elevator_stream_session_evictions",
        "Stream sessions (or their batches) evicted to stay within the budget.")
    self._head_tasks = prom.Counter(
        "elevator_head_tasks", "Tasks of the head of worker owner's streams, by the worker "
        "that computed them.", ["owner", "worker"])
    self._head_fallbacks = prom.Counter(
        "elevator_head_fallbacks", "Tasks owner dealt to worker and computed itself (that "
        "worker died, hung or failed them).", ["owner", "worker"])
    self._storage_fetched = prom.Counter(
        "elevator_storage_fetched_bytes", "Bytes read from buckets, planned ahead or not.",
        ["dataset", "planned"])
    self._storage_needed = prom.Counter(
        "elevator_storage_needed_bytes", "Bytes of the chunks steps needed from buckets.",
        ["dataset"])
    self._storage_seconds = prom.Histogram(
        "elevator_storage_request_seconds", "One ranged read from a bucket, retries included.",
        buckets=_STORAGE_BUCKETS)
    self._read_ahead = prom.Gauge("elevator_read_ahead_bytes",
                                  "Bytes the workers' read-ahead holds.",
                                  multiprocess_mode="livesum")

  def produced(self, dataset: str, seconds: float) -> None:
    self._seconds.labels(dataset).observe(seconds)

  def records_served(self, dataset: str, component: str, count: int) -> None:
    self._records.labels(dataset, component).inc(count)

  def tokens_served(self, dataset: str, component: str, count: int) -> None:
    self._tokens.labels(dataset, component).inc(count)

  def served(self, dataset: str, *, cached: bool) -> None:
    self._batches.labels(dataset).inc()
    if cached:
      self._hits.labels(dataset).inc()

  def cache_bytes(self, nbytes: int) -> None:
    self._cache_bytes.set(nbytes)

  def sent(self, dataset: str, transport: str, nbytes: int) -> None:
    self._bytes.labels(dataset, transport).inc(nbytes)

  def error(self, code: str) -> None:
    self._errors.labels(code).inc()

  def inflight(self, delta: int) -> None:
    self._inflight.inc(delta)

  def stream_sessions(self, count: int, nbytes: int) -> None:
    self._sessions.set(count)
    self._session_bytes.set(nbytes)

  def stream_session_evicted(self) -> None:
    self._evictions.inc()

  def head_task(self, owner: int, worker: int) -> None:
    self._head_tasks.labels(str(owner), str(worker)).inc()

  def head_fallback(self, owner: int, worker: int) -> None:
    self._head_fallbacks.labels(str(owner), str(worker)).inc()

  def storage_bytes(self, dataset: str, *, fetched: int = 0, needed: int = 0,
                    planned: bool = False) -> None:
    if fetched:
      self._storage_fetched.labels(dataset, "true" if planned else "false").inc(fetched)
    if needed:
      self._storage_needed.labels(dataset).inc(needed)

  def storage_request(self, seconds: float) -> None:
    self._storage_seconds.observe(seconds)

  def read_ahead_bytes(self, nbytes: int) -> None:
    self._read_ahead.set(nbytes)


_current: _Off = _Off()


def current() -> _Off:
  """This process's metrics (a no-op unless `start_recording` ran)."""
  return _current


def start_recording() -> None:
  """In a worker: record when the supervisor asked for metrics (ENV set)."""
  global _current
  if os.environ.get(ENV) and not isinstance(_current, _Recording):
    # prometheus_client picks its multiprocess values when first imported,
    # which in a worker forked by the fork server was before ENV was set.
    from prometheus_client import values  # pylint: disable=g-import-not-at-top
    values.ValueClass = values.get_value_class()
    _current = _Recording()


def _cpu_seconds(pid: int) -> float | None:
  """utime + stime of a live process, from /proc; None once it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return None


class _Quiet:
  """wsgiref's error stream, which gets a traceback for each peer that timed
  out: at debug level, so slow peers cannot flood the log."""

  def write(self, text: str) -> None:
    log.debug("metrics endpoint: %s", text.rstrip())

  def flush(self) -> None:
    pass


class _ScrapeHandler(simple_server.WSGIRequestHandler):
  """One scrape: reads and writes time out; no access log."""

  server: "_ScrapeServer"

  def setup(self) -> None:
    self.timeout = self.server.timeout_s  # StreamRequestHandler sets it on the socket
    super().setup()

  def parse_request(self) -> bool:
    ok = super().parse_request()
    self.server.request_read(self.request)
    return ok

  def get_stderr(self) -> Any:
    return _Quiet()

  def log_message(self, format: str, *args: Any) -> None:  # pylint: disable=redefined-builtin
    pass


class _ScrapeServer(socketserver.ThreadingMixIn, simple_server.WSGIServer):
  """prometheus_client's threaded WSGI server with its connections bounded
  (module docstring)."""

  daemon_threads = True
  request_queue_size = 64

  def __init__(self, host: str, port: int, app: Any, *, timeout_s: float,
               max_connections: int):
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    self.address_family = family
    self.timeout_s = timeout_s
    self.max_connections = max_connections
    self._lock = threading.Lock()
    self._open: set[socket.socket] = set()
    self._arriving: dict[socket.socket, float] = {}  # open, request not yet read
    super().__init__(address[:2], _ScrapeHandler)
    self.set_app(app)

  def process_request(self, request: Any, client_address: Any) -> None:
    with self._lock:
      if len(self._open) >= self.max_connections:
        oldest = min(self._arriving, key=self._arriving.__getitem__, default=None)
        if oldest is None:  # every one is being answered: this one waits its turn
          self.shutdown_request(request)
          return
        self._drop(oldest)
        _hang_up(oldest)  # its thread wakes from its read and ends
      self._open.add(request)
      self._arriving[request] = time.monotonic()
    try:
      super().process_request(request, client_address)
    except BaseException:
      with self._lock:
        self._drop(request)
      raise

  def process_request_thread(self, request: Any, client_address: Any) -> None:
    try:
      self.finish_request(request, client_address)
    except Exception:  # pylint: disable=broad-except
      self.handle_error(request, client_address)
    finally:
      with self._lock:  # before the close: a newcomer never hangs up a closed socket
        self._drop(request)
      self.shutdown_request(request)

  def request_read(self, request: Any) -> None:
    with self._lock:
      self._arriving.pop(request, None)

  def _drop(self, request: Any) -> None:
    self._open.discard(request)
    self._arriving.pop(request, None)

  def handle_error(self, request: Any, client_address: Any) -> None:
    log.debug("metrics endpoint: the connection from %s failed", client_address,
              exc_info=True)

  def server_close(self) -> None:
    super().server_close()
    with self._lock:
      for request in list(self._open):
        self._drop(request)
        _hang_up(request)


def _hang_up(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


class Exporter:
  """The supervisor's side: the multiprocess folder, the CPU sampler behind
  utilization, and the HTTP endpoint."""

  def __init__(self, worker_pids: Callable[[], list[int]], num_workers: int, *,
               scrape_timeout_s: float = SCRAPE_TIMEOUT_S,
               max_scrapes: int = MAX_SCRAPE_CONNECTIONS):
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
    self._http: _ScrapeServer | None = None
    self.port: int | None = None

  # -- what workers need ------------------------------------------------------

  def worker_env(self) -> dict[str, str]:
    return {ENV: self.folder}

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
      while len(self._samples) > 2 and now - self._samples[1][0] >= UTILIZATION_WINDOW_S:
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
    yield GaugeMetricFamily("elevator_workers", "Live worker processes.",
                            value=len(self._worker_pids()))
    yield CounterMetricFamily("elevator_worker_restarts", "Workers restarted after dying.",
                              value=self._restarts)
    yield GaugeMetricFamily(
        "elevator_utilization", "Busy fraction of the workers' capacity: their CPU "
        f"seconds over the last {UTILIZATION_WINDOW_S:.0f} s / (seconds x workers).",
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
    self._http = _ScrapeServer(host, port, prom.make_wsgi_app(registry),
                               timeout_s=self._scrape_timeout_s,
                               max_connections=self._max_scrapes)
    threading.Thread(target=self._http.serve_forever, daemon=True,
                     name="elevator-metrics-http").start()
    self.port = self._http.server_port
    return self.port

  def stop(self) -> None:
    self._stop.set()
    if self._http is not None:
      self._http.shutdown()
      self._http.server_close()
    shutil.rmtree(self.folder, ignore_errors=True)
