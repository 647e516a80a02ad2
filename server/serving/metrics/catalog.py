"""Every metric the server exports, defined once: its name, kind, labels and help.

The recorder and the exporter make their Prometheus objects from these
definitions, and the table of metrics in docs/operations.md is rendered from
them (`python docs/hooks.py`; tests/tools/test_docs.py fails when the
committed table differs). `help` is what a scrape's `# HELP` line says;
`notes` adds what only the docs say (markdown, links relative to docs/).
"""

from __future__ import annotations

import dataclasses

# The window utilization is measured over: part of what the metric means.
UTILIZATION_WINDOW_S = 30.0

# Producing a step takes ~0.1 ms (small rows) to ~1 s (big image batches).
_BATCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0)
# A bucket's ranged read: ~1 ms (a local emulator) to seconds (retries).
_STORAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


@dataclasses.dataclass(frozen=True)
class Metric:
  """One metric as Prometheus names it (a counter's samples add `_total`)."""

  name: str
  kind: str  # "counter", "gauge" or "histogram"
  help: str
  labels: tuple[str, ...] = ()
  notes: str = ""
  buckets: tuple[float, ...] | None = None  # a histogram's
  # A worker's gauge: summed over the live workers (prometheus_client's
  # multiprocess mode); a dead worker's value is dropped.
  multiprocess_mode: str | None = None

  @property
  def scraped_name(self) -> str:
    """The name a scrape shows: a counter's samples end in `_total`."""
    return self.name + "_total" if self.kind == "counter" else self.name


# -- what the workers record (server/serving/metrics/recorder.py) ----------------

BATCHES = Metric(
    "elevator_batches", "counter", "Steps served (produced or cached).", ("dataset",),
    notes="A stream dataset's steps count too, one per host.")
BATCH_CACHE_HITS = Metric(
    "elevator_batch_cache_hits", "counter",
    "Steps served from the cache shared between trainers.", ("dataset",),
    notes="Of `elevator_batches_total`; for a stream dataset, the steps taken from a global "
          "batch another host's request produced (the 2nd to Hth host of a job).")
BATCH_CACHE_BYTES = Metric(
    "elevator_batch_cache_bytes", "gauge", "Bytes the workers' batch caches hold.",
    notes="Not a stream's sessions (`elevator_stream_session_bytes`).",
    multiprocess_mode="livesum")
STREAM_SESSIONS = Metric(
    "elevator_stream_sessions", "gauge", "Stream sessions the workers hold.",
    multiprocess_mode="livesum")
STREAM_SESSION_BYTES = Metric(
    "elevator_stream_session_bytes", "gauge",
    "Bytes of the stream sessions' global batches and live iterators (estimated).",
    multiprocess_mode="livesum")
STREAM_SESSION_EVICTIONS = Metric(
    "elevator_stream_session_evictions", "counter",
    "Stream sessions (or their batches) evicted to stay within the budget.",
    notes="The budget is the sessions' share of `--batch-cache-mb` and their count.")
BYTES_SENT = Metric(
    "elevator_bytes_sent", "counter", "Batch bytes handed to the socket.",
    ("dataset", "transport"), notes="`transport` is `bulk` or `grpc`.")
RECORDS_SERVED = Metric(
    "elevator_records_served", "counter",
    "Records in the rows sent, by dataset and mixture component (the dataset's own name for "
    "one that is not a mixture; padding rows not counted); for a stream dataset, its rows.",
    ("dataset", "component"),
    notes="Counted per host slice sent, so a step read by H hosts counts its records once in "
          "all. The same counts over any range of steps, computed rather than scraped: "
          "`elevator explain --summary START:END` "
          "([What a step held](client.md#counts-over-a-range-of-steps)).")
TOKENS_SERVED = Metric(
    "elevator_tokens_served", "counter",
    "Tokens in the rows sent: the non-padding slots of a packed batch's segment ids "
    "(leaves named *segment_ids).", ("dataset", "component"),
    notes="Grain's packers write those leaves. A stream dataset's tokens are counted under "
          "its own name, a stream over a mixture's too: which component a token came from "
          "is known only by tracing, which the summary does (`elevator explain --summary`, "
          "[per source](client.md#counts-over-a-range-of-steps)) rather than every served "
          "step.")
REQUEST_ERRORS = Metric(
    "elevator_request_errors", "counter", "Requests answered with an error status.",
    ("code",),
    notes="`code` is the status code's name (`NOT_FOUND`, `RESOURCE_EXHAUSTED`, ...: "
          "[the error table](protocol.md#errors-on-the-wire)).")
BATCH_SECONDS = Metric(
    "elevator_batch_seconds", "histogram", "Time to produce one step.", ("dataset",),
    notes="A stream dataset's: one global batch.", buckets=_BATCH_BUCKETS)
INFLIGHT_REQUESTS = Metric(
    "elevator_inflight_requests", "gauge", "Admitted requests.",
    notes="Every worker's, summed.", multiprocess_mode="livesum")
HEAD_TASKS = Metric(
    "elevator_head_tasks", "counter",
    "Tasks of the head of worker owner's streams, by the worker that computed them.",
    ("owner", "worker"),
    notes="A task is `TASK_ELEMENTS` elements of a stream's head; `owner` and `worker` are "
          "worker indices, `owner` itself included: how a stream's CPU is spread over the "
          "workers.")
HEAD_FALLBACKS = Metric(
    "elevator_head_fallbacks", "counter",
    "Tasks owner dealt to worker and computed itself (that worker died, hung or failed "
    "them).", ("owner", "worker"), notes="Each such event is also one log line.")
STORAGE_FETCHED_BYTES = Metric(
    "elevator_storage_fetched_bytes", "counter",
    "Bytes read from buckets, planned ahead or not.", ("dataset", "planned"),
    notes="[Data in buckets](buckets.md#reads-by-plan): `planned=\"true\"` ahead of the steps "
          "that need them, `\"false\"` by a step itself.")
STORAGE_NEEDED_BYTES = Metric(
    "elevator_storage_needed_bytes", "counter",
    "Bytes of the chunks steps needed from buckets.", ("dataset",),
    notes="Fetched ÷ needed is the read amplification.")
STORAGE_GETS = Metric(
    "elevator_storage_gets", "counter",
    "Ranged GETs sent to buckets, by outcome.", ("dataset", "outcome"),
    notes="`answered`, `failed`, `refused` (503 SlowDown or 429: the prefix's window is "
          "halved), and besides those `retried` (asked again after a wait) and `hedged` (a "
          "straggler asked again past the p95). A GET costs $0.0004 per 1,000 on S3 and GCS "
          "([what a GET costs](buckets.md#what-a-get-costs)).")
STORAGE_REQUEST_SECONDS = Metric(
    "elevator_storage_request_seconds", "histogram",
    "One ranged read from a bucket, retries included.", buckets=_STORAGE_BUCKETS)
CACHE_READ_BYTES = Metric(
    "elevator_cache_read_bytes", "counter",
    "Bytes of the chunks steps read from bucket objects, by where they were found.",
    ("dataset", "found"),
    notes="[The cache](buckets.md#the-cache): `found=\"cache\"` read from `--cache-dir`, "
          "`\"bucket\"` read from the bucket. The hit ratio is cache ÷ (cache + bucket).")
CACHE_FILLED_BYTES = Metric(
    "elevator_cache_filled_bytes", "counter",
    "Bytes written to the cache, each block fetched once in one ranged GET.", ("dataset",))
CACHE_BYTES = Metric(
    "elevator_cache_bytes", "gauge", "Bytes the cache holds, of what it was asked to hold.",
    ("of",), notes="`of=\"held\"` on disk (fills under way included), `\"wanted\"` the "
                   "size of every bucket object the server reads: their ratio is the warm-up's "
                   "progress.", multiprocess_mode="max")
READ_AHEAD_BYTES = Metric(
    "elevator_read_ahead_bytes", "gauge", "Bytes the workers' read-ahead holds.",
    notes="Arrived or on their way; at most `--read-ahead-mb` a worker.",
    multiprocess_mode="livesum")

# -- what the supervisor adds (server/serving/metrics/exporter.py) --------------

WORKERS = Metric("elevator_workers", "gauge", "Live worker processes.")
WORKER_RESTARTS = Metric("elevator_worker_restarts", "counter",
                         "Workers restarted after dying.")
UTILIZATION = Metric(
    "elevator_utilization", "gauge",
    "Busy fraction of the workers' capacity: their CPU seconds over the last "
    f"{UTILIZATION_WINDOW_S:.0f} s / (seconds x workers).",
    notes="In [0, 1]: the signal to scale the data tier on.")

# Every metric, in the order the docs list them.
METRICS: tuple[Metric, ...] = (
    BATCHES, BATCH_CACHE_HITS, BATCH_CACHE_BYTES, STREAM_SESSIONS, STREAM_SESSION_BYTES,
    STREAM_SESSION_EVICTIONS, BYTES_SENT, RECORDS_SERVED, TOKENS_SERVED, REQUEST_ERRORS,
    BATCH_SECONDS, INFLIGHT_REQUESTS, HEAD_TASKS, HEAD_FALLBACKS, STORAGE_FETCHED_BYTES,
    STORAGE_NEEDED_BYTES, STORAGE_GETS, STORAGE_REQUEST_SECONDS, READ_AHEAD_BYTES,
    CACHE_READ_BYTES, CACHE_FILLED_BYTES, CACHE_BYTES, WORKERS,
    WORKER_RESTARTS, UTILIZATION)
