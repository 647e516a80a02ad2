"""What a worker counts: one recorder per process, a no-op unless asked for.

Workers are separate processes that come and go (restarts), so they use
prometheus_client's multiprocess mode: each writes its samples to files of
its own in the folder the supervisor names in ENV before starting it
(exporter.py sums them). Without `--metrics-port` (and in embedded mode)
ENV is unset and recording is a no-op.
"""

from __future__ import annotations

import os
from typing import Any

from grain_elevator.server.serving.metrics import catalog

ENV = "PROMETHEUS_MULTIPROC_DIR"


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

  def storage_get(self, dataset: str, outcome: str) -> None:
    pass

  def read_ahead_bytes(self, nbytes: int) -> None:
    pass

  def cache_read(self, dataset: str, *, hit_bytes: int, miss_bytes: int) -> None:
    pass

  def cache_filled(self, dataset: str, nbytes: int) -> None:
    pass

  def object_cache_bytes(self, nbytes: int, wanted: int) -> None:
    pass


def _made(metric: catalog.Metric) -> Any:
  """The prometheus_client object a worker records `metric` in."""
  import prometheus_client as prom  # pylint: disable=g-import-not-at-top
  if metric.kind == "counter":
    return prom.Counter(metric.name, metric.help, metric.labels)
  if metric.kind == "histogram":
    return prom.Histogram(metric.name, metric.help, metric.labels, buckets=metric.buckets)
  mode = {"multiprocess_mode": metric.multiprocess_mode} if metric.multiprocess_mode else {}
  return prom.Gauge(metric.name, metric.help, metric.labels, **mode)


class _Recording(_Off):
  """A worker's metrics, written to its files in $PROMETHEUS_MULTIPROC_DIR."""

  on = True

  def __init__(self) -> None:
    self._records = _made(catalog.RECORDS_SERVED)
    self._tokens = _made(catalog.TOKENS_SERVED)
    self._batches = _made(catalog.BATCHES)
    self._hits = _made(catalog.BATCH_CACHE_HITS)
    self._cache_bytes = _made(catalog.BATCH_CACHE_BYTES)
    self._bytes = _made(catalog.BYTES_SENT)
    self._errors = _made(catalog.REQUEST_ERRORS)
    self._seconds = _made(catalog.BATCH_SECONDS)
    self._inflight = _made(catalog.INFLIGHT_REQUESTS)
    self._sessions = _made(catalog.STREAM_SESSIONS)
    self._session_bytes = _made(catalog.STREAM_SESSION_BYTES)
    self._evictions = _made(catalog.STREAM_SESSION_EVICTIONS)
    self._head_tasks = _made(catalog.HEAD_TASKS)
    self._head_fallbacks = _made(catalog.HEAD_FALLBACKS)
    self._storage_fetched = _made(catalog.STORAGE_FETCHED_BYTES)
    self._storage_needed = _made(catalog.STORAGE_NEEDED_BYTES)
    self._storage_seconds = _made(catalog.STORAGE_REQUEST_SECONDS)
    self._storage_gets = _made(catalog.STORAGE_GETS)
    self._read_ahead = _made(catalog.READ_AHEAD_BYTES)
    self._cache_read = _made(catalog.CACHE_READ_BYTES)
    self._cache_filled = _made(catalog.CACHE_FILLED_BYTES)
    self._object_cache = _made(catalog.CACHE_BYTES)

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

  def storage_get(self, dataset: str, outcome: str) -> None:
    self._storage_gets.labels(dataset, outcome).inc()

  def read_ahead_bytes(self, nbytes: int) -> None:
    self._read_ahead.set(nbytes)

  def cache_read(self, dataset: str, *, hit_bytes: int, miss_bytes: int) -> None:
    if hit_bytes:
      self._cache_read.labels(dataset, "cache").inc(hit_bytes)
    if miss_bytes:
      self._cache_read.labels(dataset, "bucket").inc(miss_bytes)

  def cache_filled(self, dataset: str, nbytes: int) -> None:
    self._cache_filled.labels(dataset).inc(nbytes)

  def object_cache_bytes(self, nbytes: int, wanted: int) -> None:
    self._object_cache.labels("held").set(nbytes)
    self._object_cache.labels("wanted").set(wanted)


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
