"""Is the trainer waiting on data? The client's answer, kept per iterator.

The one figure that says whether the data tier keeps up is the share of
the trainer's time spent blocked in `next()`: near 0, the input pipeline is
not the bottleneck; growing, add server workers or replicas (or prefetch).
Beside it, `window`: the steps the iterator keeps in flight now, which a
default client adapts (client/window.py): at its most while the trainer
still waits, the tier is short of workers, not the client of requests.
`RemoteDataset.stats()` returns it with throughput, retries and transport
fallbacks, and the iterator logs it as one line every `stats_log_s`.
`start_metrics_server(port)` also serves every live iterator's figures to
Prometheus, per dataset, from the trainer process.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from grain_elevator.client.backend import Backend
from grain_elevator.client.read_spec import ReadSpec

log = logging.getLogger("grain_elevator.client")


@dataclasses.dataclass(frozen=True)
class Stats:
  """Counts since an iterator's first `next()` (summed over iterators by
  `RemoteDataset.stats()`)."""
  steps: int = 0
  bytes: int = 0  # of the arrays delivered
  wall_s: float = 0.0  # from the first next() to now
  wait_s: float = 0.0  # of it, blocked in next() waiting for a step
  retries: int = 0  # failed attempts tried again (another replica, a backoff)
  fallbacks: int = 0  # requests moved from the bulk transport to gRPC
  window: int = 0  # steps kept in flight now (the adaptive window: client/window.py)

  @property
  def wait_ratio(self) -> float:
    """Share of the wall time the trainer waited for data, in [0, 1]."""
    return min(1.0, self.wait_s / self.wall_s) if self.wall_s > 0 else 0.0

  @property
  def bytes_per_s(self) -> float:
    return self.bytes / self.wall_s if self.wall_s > 0 else 0.0

  def __add__(self, other: "Stats") -> "Stats":
    return Stats(*(a + b for a, b in zip(dataclasses.astuple(self),
                                          dataclasses.astuple(other))))

  def line(self) -> str:
    """One line for a log: what a trainer's author reads first."""
    return (f"{self.steps:,} steps in {self.wall_s:.1f}s; waited {self.wait_s:.2f}s for "
            f"data ({self.wait_ratio:.1%} of the time); {self.bytes_per_s / 1e6:,.1f} MB/s; "
            f"{self.retries} retries, {self.fallbacks} fallbacks to gRPC; "
            f"{self.window} steps in flight")


class Meter:
  """Times one iterator's `next()` calls; logs `Stats.line` every `log_every_s`."""

  def __init__(self, name: str, log_every_s: float,
               counters: Callable[[], tuple[int, int]] = lambda: (0, 0), dataset: str = "",
               window: Callable[[], int] = lambda: 0):
    """`counters`: the connections' (retries, fallbacks) so far; `window`:
    the steps the iterator keeps in flight now."""
    self._name = name
    self._window = window
    self.dataset = dataset
    _METERS.add(self)
    self._counters = counters
    self._log_every_s = log_every_s
    self._lock = threading.Lock()
    self._start: float | None = None
    self._next_log = 0.0
    self._steps = 0
    self._bytes = 0
    self._wait_s = 0.0

  def delivered(self, called_at: float, got_at: float, nbytes: int) -> None:
    """A step left `next()`, called at `called_at` and ready at `got_at`
    (time.monotonic()); logs the summary when one is due."""
    with self._lock:
      if self._start is None:
        self._start = called_at
        self._next_log = called_at + self._log_every_s
      self._steps += 1
      self._bytes += nbytes
      self._wait_s += got_at - called_at
      due = self._log_every_s > 0 and got_at >= self._next_log
      if due:
        self._next_log = got_at + self._log_every_s
    if due:
      log.info("%s: %s", self._name, self.stats().line())

  def stats(self) -> Stats:
    retries, fallbacks = self._counters()
    with self._lock:
      wall = time.monotonic() - self._start if self._start is not None else 0.0
      return Stats(self._steps, self._bytes, wall, self._wait_s, retries, fallbacks,
                   self._window())


_METERS: "weakref.WeakSet[Meter]" = weakref.WeakSet()


def meter_for(spec: ReadSpec, backend: Backend, window: Callable[[], int] = lambda: 0) -> Meter:
  """The meter of an iterator reading `spec` from `backend`, keeping
  `window()` steps in flight."""
  return Meter(str(spec), spec.stats_log_s, lambda: (
      getattr(backend, "retries", 0), getattr(backend, "fallbacks", 0)), dataset=spec.dataset,
      window=window)


class _Collector:
  """Every live iterator's Stats, summed per dataset (a prometheus_client collector)."""

  def collect(self) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # pylint: disable=g-import-not-at-top
    per: dict[str, Stats] = {}
    for meter in list(_METERS):
      per[meter.dataset] = per.get(meter.dataset, Stats()) + meter.stats()
    families = {
        "steps": CounterMetricFamily("elevator_client_steps", "Steps delivered.",
                                     labels=["dataset"]),
        "bytes": CounterMetricFamily("elevator_client_bytes", "Bytes of arrays delivered.",
                                     labels=["dataset"]),
        "wait_s": CounterMetricFamily("elevator_client_wait_seconds",
                                      "Time the trainer was blocked in next().",
                                      labels=["dataset"]),
        "wall_s": CounterMetricFamily("elevator_client_wall_seconds",
                                      "Time since each iterator's first next().",
                                      labels=["dataset"]),
        "retries": CounterMetricFamily("elevator_client_retries", "Attempts tried again.",
                                       labels=["dataset"]),
        "fallbacks": CounterMetricFamily("elevator_client_fallbacks",
                                         "Requests moved from bulk to gRPC.",
                                         labels=["dataset"]),
    }
    ratio = GaugeMetricFamily("elevator_client_wait_ratio",
                              "Share of the wall time spent waiting for data.",
                              labels=["dataset"])
    window = GaugeMetricFamily("elevator_client_window_steps",
                               "Steps kept in flight now (the adaptive window).",
                               labels=["dataset"])
    for dataset, stats in per.items():
      for field, family in families.items():
        family.add_metric([dataset], getattr(stats, field))
      ratio.add_metric([dataset], stats.wait_ratio)
      window.add_metric([dataset], stats.window)
    yield from families.values()
    yield ratio
    yield window


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
  """Serves this process's iterators' stats at http://host:port/metrics
  (0: a free port); returns the port. Needs prometheus_client."""
  import prometheus_client as prom  # pylint: disable=g-import-not-at-top
  registry = prom.CollectorRegistry()
  registry.register(_Collector())
  server, _ = prom.start_http_server(port, addr=host, registry=registry)
  return server.server_port
