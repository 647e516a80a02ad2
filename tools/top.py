"""`elevator top HOST:METRICS_PORT`: a live view of one server's metrics.

Scrapes `/metrics` (`elevator serve --metrics-port`) every `--interval`
seconds and shows what an operator asks first: how busy the workers are,
how many batches and bytes go out per second (per dataset, per transport),
what share of the batches the cache shared between trainers served, how long a batch takes to produce, and which errors clients get. Rates are
differences between two scrapes, so the first view comes after one interval.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str, timeout_s: float = 5.0) -> Samples:
  """{(sample name, sorted labels): value} of one scrape of HOST:PORT/metrics."""
  url = address if "://" in address else f"http://{address}/metrics"
  with urllib.request.urlopen(url, timeout=timeout_s) as r:
    text = r.read().decode()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
  return {dict(labels)[label]: v for (n, labels), v in samples.items()
          if n == name and label in dict(labels)}


def _quantile(buckets: dict[float, float], q: float) -> float | None:
  """The upper bound of the histogram bucket holding quantile q (None if empty)."""
  if not buckets or max(buckets.values()) <= 0:
    return None
  total = buckets[max(buckets)]
  for bound in sorted(buckets):
    if buckets[bound] >= q * total:
      return bound
  return None


@dataclasses.dataclass
class View:
  """What changed between two scrapes, `seconds` apart."""
  seconds: float
  workers: float
  restarts: float
  utilization: float
  inflight: float
  batches_per_s: dict[str, float]
  mb_per_s: dict[str, float]  # "dataset/transport"
  errors_per_s: dict[str, float]
  p50_s: dict[str, float | None]
  p99_s: dict[str, float | None]
  cache_hits_per_s: dict[str, float] = dataclasses.field(default_factory=dict)

  @classmethod
  def between(cls, a: Samples, b: Samples, seconds: float) -> "View":
    def rate(name: str, label: str) -> dict[str, float]:
      old = _by(a, name, label)
      return {k: (v - old.get(k, 0.0)) / seconds for k, v in _by(b, name, label).items()}

    sent_old = {tuple(dict(lb).values()): v for (n, lb), v in a.items()
                if n == "elevator_bytes_sent_total"}
    mb = {}
    for (n, labels), v in b.items():
      if n == "elevator_bytes_sent_total":
        key = tuple(dict(labels).values())
        mb["/".join(key)] = (v - sent_old.get(key, 0.0)) / seconds / 1e6
    p50, p99 = {}, {}
    for dataset in _by(b, "elevator_batch_seconds_count", "dataset"):
      buckets = {}
      for (n, labels), v in b.items():
        d = dict(labels)
        if n == "elevator_batch_seconds_bucket" and d.get("dataset") == dataset:
          before = a.get((n, labels), 0.0)
          buckets[float(d["le"])] = v - before
      p50[dataset], p99[dataset] = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
    get = lambda name: b.get((name, ()), 0.0)  # noqa: E731
    return cls(seconds, get("elevator_workers"), get("elevator_worker_restarts_total"),
               get("elevator_utilization"), get("elevator_inflight_requests"),
               rate("elevator_batches_total", "dataset"), mb,
               rate("elevator_request_errors_total", "code"), p50, p99,
               rate("elevator_batch_cache_hits_total", "dataset"))

  def lines(self) -> Iterator[str]:
    """The view as plain text (also what `--once` prints)."""
    yield (f"workers {self.workers:.0f}   utilization {self.utilization:.0%}   "
           f"in flight {self.inflight:.0f}   restarts {self.restarts:.0f}")
    for d, r in sorted(self.batches_per_s.items()):
      p50, p99 = self.p50_s.get(d), self.p99_s.get(d)
      lat = (f"   batch time p50 ≤ {p50 * 1e3:g} ms, p99 ≤ {p99 * 1e3:g} ms"
             if p50 is not None and p99 is not None else "")
      hits = self.cache_hits_per_s.get(d, 0.0)
      shared = f" ({hits / r:.0%} from the cache)" if r > 0 and hits > 0 else ""
      yield f"dataset {d}: {r:,.1f} batches/s{shared}{lat}"
    for k, r in sorted(self.mb_per_s.items()):
      yield f"sent {k}: {r:,.1f} MB/s"
    for code, r in sorted(self.errors_per_s.items()):
      if r > 0:
        yield f"errors {code}: {r:,.2f}/s"


def run(address: str, interval_s: float = 2.0, once: bool = False) -> int:
  """Shows the view every `interval_s` until Ctrl-C (`once`: one view, plain)."""
  before, t0 = scrape(address), time.monotonic()
  if once:
    time.sleep(interval_s)
    after = scrape(address)
    for line in View.between(before, after, time.monotonic() - t0).lines():
      print(line)
    return 0
  from rich.live import Live  # pylint: disable=g-import-not-at-top
  from rich.panel import Panel  # pylint: disable=g-import-not-at-top
  try:
    with Live(Panel("waiting for the second scrape ...", title=address),
              refresh_per_second=4) as live:
      while True:
        time.sleep(interval_s)
        after, t1 = scrape(address), time.monotonic()
        view = View.between(before, after, t1 - t0)
        live.update(Panel("\n".join(view.lines()), title=f"elevator top {address}"))
        before, t0 = after, t1
  except KeyboardInterrupt:
    return 0
