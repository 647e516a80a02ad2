"""Prometheus metrics: every worker records its own, the supervisor serves one scrape.

One module per concern:

  catalog.py   every metric, defined once (name, kind, labels, help); the
               table of metrics in docs/operations.md is rendered from it
  recorder.py  what a worker counts (`current()`), into prometheus_client's
               multiprocess files; a no-op without `--metrics-port`
  exporter.py  the supervisor's side: the multiprocess folder, the sum over
               the workers, utilization from their CPU time
  scrape.py    the HTTP endpoint, its connections bounded

Callers use the names below: `metrics.current().served(...)` in a worker,
`metrics.Exporter(...)` in the supervisor.
"""

from __future__ import annotations

from grain_elevator.server.serving.metrics.catalog import UTILIZATION_WINDOW_S
from grain_elevator.server.serving.metrics.exporter import Exporter
from grain_elevator.server.serving.metrics.recorder import ENV, current, start_recording
from grain_elevator.server.serving.metrics.scrape import (MAX_SCRAPE_CONNECTIONS,
                                                          SCRAPE_TIMEOUT_S)

__all__ = ["ENV", "Exporter", "MAX_SCRAPE_CONNECTIONS", "SCRAPE_TIMEOUT_S",
           "UTILIZATION_WINDOW_S", "current", "start_recording"]
