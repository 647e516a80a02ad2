"""`elevator bench --storage s3`: the small and image workloads (and text,
bucket_text.py) read from the stand-in S3 store (tools/testing/object_store.py:
thousands of GETs a second, each answered after a time to first byte drawn
from a log-normal, `--storage-ttfb-ms P50,P99`, default 25,150), against,
in one run, interleaved:

- the server reading from the bucket by plan (its defaults);
- the server with its cache of bucket objects (`--cache-dir`), cold: a
  fresh server and an empty folder for each run, measured from its first
  epoch while the cache fills in the background; and warm: a server whose
  cache holds every object (`elevator_cache_bytes{of="held"}` ==
  `{of="wanted"}`) before its first run;
- local Grain reading the bucket record by record through file-like
  objects, as over a FUSE mount (bucket_sources.PerRecordSource), with 16
  read threads;
- local Grain over whole shards downloaded into a bounded local cache, read
  in a windowed shuffle (bucket_sources.ShardCacheSource, Mosaic
  Streaming's and LitData's pattern), its window a fraction of the dataset;
- the same server reading the same shards from local files.

Every figure of the bucket comes from the store itself over each run's
counted window (the trainer's process resets the store's stats when its
warm-up ends and reads them when its window ends: `_Probe`): GETs (every
request) per record, read amplification (bytes the store sent ÷ the stored
bytes of those records), the GET cost per TB delivered at list price, and
the requests in flight (time-weighted mean and peak). "Those records" are
the ones made in the window: for a server, what its metrics say it served
between the window's edges (`elevator_records_served_total`; text: its
tokens ÷ the mean tokens of a document), since a client's prefetch (64
steps of small) is still filling when a short window begins; for local
Grain, the records its trainer took. The servers' own counts (GETs by
outcome, their fetched ÷ needed, cache hits) come from their metrics
before and after each run. Every server runs without its batch cache
(SERVE_ARGS): each run reads the same stream from step 0.

`--pace N` makes the trainer take at most N records a second (text: rows): it
works G/N seconds on each batch before asking for the next. `--storage-max-rate
N` has the store refuse past N requests a second per prefix (503 SlowDown).
On the image workload a bare obstore reader (store_rate.bare_reads) reads
the records' ranges from the same store after each round: its CPU per GET
is what the server's CPU per record read from the bucket is set beside.
Before each workload, store_rate.ceiling measures how many GETs a second the
store answers on this machine: figures far below it measure the reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

from grain_elevator.tools.bench import defaults
from grain_elevator.tools.bench import harness
from grain_elevator.tools.bench import images
from grain_elevator.tools.bench import run as run_lib
from grain_elevator.tools.bench import workloads as workloads_lib
from grain_elevator.tools import top
from grain_elevator.tools.testing import storage_servers
from grain_elevator.tools.testing.storage_servers import free_port
from grain_elevator.tools.testing.launcher import LocalServer

BUCKET = "elevator-bench"
TTFB_MS = defaults.BUCKET_TTFB_MS
# Shards as a real bucket's hold them (100 MB-1 GB), where the dataset allows:
# this size, and at least MIN_SHARDS (a worker's share, and more than one
# shard for each of the whole-shard reader's windows).
SHARD_BYTES = 64 << 20
MIN_SHARDS = 4
RECORDS = defaults.BUCKET_RECORDS  # per workload
GRAIN_THREADS = 16
# The whole-shard reader's shuffle window, as a fraction of the dataset; its
# cache holds two windows and two shards more, so it never downloads a
# shard twice in an epoch.
WINDOW_FRACTION = 0.25
# List price of a GET on S3 and GCS (standard class): $0.0004 per 1,000.
GET_PRICE = 0.0004 / 1000
# Requests the bare obstore reader keeps in flight.
BARE_IN_FLIGHT = 64
# Most seconds the warm cache may take to fill before its first run, and how
# long its held gauge may stay short of what it was asked to hold once every
# byte of it was filled.
FILL_TIMEOUT_S = 600.0
HELD_GRACE_S = 5.0
WORKLOADS = ("small", "image", "text")  # text: bucket_text.py
BARE_WORKLOADS = ("image",)  # where the bare obstore reader runs
SERVERS = ("local", "bucket", "cache_cold", "cache_warm")
# Every server's options besides its defaults: no batch cache. Each run reads
# the same stream from step 0, so a server's batch cache would serve a later
# run's steps from memory (a second trainer's case, not one trainer's), and
# those runs would not read the bucket at all.
SERVE_ARGS = ("--batch-cache-mb", "0")


@dataclasses.dataclass(frozen=True)
class StoreSettings:
  """What the stand-in store and the trainer are told: the time to first
  byte (ms: p50, p99), the most requests a second per prefix (0: any), and
  the trainer's pace (records a second; 0: as fast as it can)."""

  ttfb_ms: tuple[float, float] = TTFB_MS
  max_rate: float = 0.0
  pace: float = 0.0


@dataclasses.dataclass
class Setup:
  """A workload written locally and ready to be read from the bucket."""

  name: str  # the dataset's name, and the bucket folder
  text: bool  # tokens/s of packed rows, not records/s
  config: str  # the local files' config
  files: list[str]
  global_batch_size: int
  service: dict[str, Any]  # a service system's spec, less target and server_pids
  grain: dict[str, Any]  # a local Grain system's spec, less its bucket_source
  tokens_per_record: float = 0.0  # text: tokens of a document, on average


def _client(w: workloads_lib.Workload, workers: int) -> dict[str, Any]:
  if w.kind == "image":
    return images.client_settings(workers)
  return run_lib.client_settings(w, workers)


def shard_count(records: int, record_bytes: int) -> int:
  """Shards of about SHARD_BYTES, at least MIN_SHARDS, none empty."""
  wanted = max(MIN_SHARDS, -(-records * record_bytes // SHARD_BYTES))
  wanted = min(wanted, records)
  return -(-records // -(-records // wanted))  # so that none is empty (write_shards fills in order)


@contextlib.contextmanager
def bucket_copy(name: str, files: list[str], root: pathlib.Path,
                settings: StoreSettings = StoreSettings()
                ) -> Iterator[tuple[Any, list[str], dict[str, str]]]:
  """The stand-in store holding `files` under s3://BUCKET/NAME/ (hard links
  where the folder allows, so the store and the local files share the page
  cache), answering as `settings` says: (the store, the objects' URLs, the
  environment that reaches them)."""
  from grain_elevator.tools.testing.object_store import StandInStore  # pylint: disable=g-import-not-at-top
  root.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="elevator-bench-store-", dir=root) as store_root:
    folder = pathlib.Path(store_root) / BUCKET / name
    folder.mkdir(parents=True)
    for f in files:
      try:
        os.link(f, folder / os.path.basename(f))
      except OSError:
        shutil.copyfile(f, folder / os.path.basename(f))
    p50, p99 = settings.ttfb_ms
    with StandInStore(store_root, "s3", ttfb_p50_ms=p50, ttfb_p99_ms=p99,
                      max_rate=settings.max_rate) as store:
      yield store, [f"s3://{BUCKET}/{name}/{os.path.basename(f)}" for f in files], store.env()


def bucket_config_of(config: str, name: str) -> pathlib.Path:
  """A copy of the workload's config beside it whose paths are the bucket's."""
  text = pathlib.Path(config).read_text().replace(
      f'paths = ["{name}/*.array_record"]', f'paths = ["s3://{BUCKET}/{name}/*.array_record"]')
  path = pathlib.Path(config).parent / f"{name}-s3.toml"
  path.write_text(text)
  return path


def _readers(urls: list[str], env: dict[str, str]) -> list[Any]:
  """The server's shard readers of the objects at `urls` (footers read)."""
  from grain_elevator.server.data.object_source import ObjectRecordSource  # pylint: disable=g-import-not-at-top
  with storage_servers.environment(env):
    return ObjectRecordSource(urls)._readers  # pylint: disable=protected-access


def stored_bytes(urls: list[str], env: dict[str, str]) -> tuple[int, int]:
  """(records, bytes of their chunks) of the shards at `urls`."""
  readers = _readers(urls, env)
  records = sum(r.num_records for r in readers)
  return records, sum(b - a for r in readers for a, b in r.extents(range(r.num_records)))


def record_ranges(urls: list[str], env: dict[str, str]) -> list[tuple[str, int, int, str]]:
  """Each record's chunk as the server reads it: (key, begin, end, ETag)."""
  out = []
  for url, r in zip(urls, _readers(urls, env)):
    key = url.split("://", 1)[1].partition("/")[2]
    for a, b in r.extents(range(r.num_records)):
      out.append((key, a, b, r.obj.etag or ""))
  return out


def server_counts(port: int) -> dict[str, float]:
  """A server's storage and cache counts, from its metrics."""
  m = top.scrape(f"127.0.0.1:{port}", timeout_s=30)

  def total(name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))

  out = {"needed": total("elevator_storage_needed_bytes_total"),
         "fetched": total("elevator_storage_fetched_bytes_total"),
         "cache_hit": total("elevator_cache_read_bytes_total", found="cache"),
         "cache_miss": total("elevator_cache_read_bytes_total", found="bucket"),
         "filled": total("elevator_cache_filled_bytes_total"),
         "held": total("elevator_cache_bytes", of="held"),
         "wanted": total("elevator_cache_bytes", of="wanted"),
         "records_served": total("elevator_records_served_total")}
  for outcome in ("answered", "failed", "refused", "retried", "hedged"):
    out[f"gets_{outcome}"] = total("elevator_storage_gets_total", outcome=outcome)
  return out


def server_bytes(port: int) -> tuple[float, float, float]:
  """(bytes the server's steps needed from the bucket, bytes it fetched,
  bytes its plans hold for steps not made yet), from its metrics."""
  m = top.scrape(f"127.0.0.1:{port}", timeout_s=30)
  total = lambda name: sum(v for (n, _), v in m.items() if n == name)  # noqa: E731
  return (total("elevator_storage_needed_bytes_total"),
          total("elevator_storage_fetched_bytes_total"),
          m.get(("elevator_read_ahead_bytes", ()), 0.0))


# -- in the trainer's process ------------------------------------------------------------


def _store_call(url: str, method: str, name: str) -> dict[str, Any]:
  import json  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  req = urllib.request.Request(f"{url}/_standin/{name}", method=method,
                               data=b"{}" if method == "POST" else None)
  with urllib.request.urlopen(req, timeout=30) as r:
    return json.loads(r.read())


class _Probe:
  """The trainer's iterator, seen by the bench: it keeps the pace (a batch
  of G records takes G / pace seconds of work before the next is asked
  for), resets the store's stats when consume.py's warm-up ends (its first
  call past `warmup_s` after the first batch) and reads them when the
  iterator is closed (consume.py closes it when its window ends), counting
  the records (and tokens) taken in between."""

  def __init__(self, it: Any, spec: dict[str, Any], out: dict[str, Any]):
    self._it, self._out = it, out
    self._g = spec["global_batch_size"]
    self._pace = float(spec.get("pace") or 0.0)
    self._store = spec.get("store_url")
    self._metrics = spec.get("probe_metrics")
    self._text = spec.get("pipeline") == "text"
    self._warmup = spec["warmup_s"]
    self._first = None  # when the first batch came
    self._began = None  # when the window began
    self._ready = 0.0
    self._records = self._tokens = 0

  def __iter__(self) -> "_Probe":
    return self

  def __next__(self) -> Any:
    now = time.perf_counter()
    if self._first is not None and self._began is None and now >= self._first + self._warmup:
      if self._store:
        _store_call(self._store, "POST", "reset")
      if self._metrics:
        self._out["metrics_begin"] = _scrape_window(self._metrics)
      self._began = time.perf_counter()
    if self._pace and now < self._ready:
      time.sleep(self._ready - now)
    batch = next(self._it)
    done = time.perf_counter()
    if self._first is None:
      self._first = done
    if self._pace:
      self._ready = done + self._g / self._pace
    if self._began is not None:
      self._records += self._g
      if self._text:
        import numpy as np  # pylint: disable=g-import-not-at-top
        self._tokens += int(np.count_nonzero(np.asarray(batch["tokens_segment_ids"])))
    return batch

  def close(self) -> None:
    if self._began is not None and "window_s" not in self._out:
      self._out.update(window_s=time.perf_counter() - self._began, records=self._records,
                       tokens=self._tokens)
      if self._store:
        self._out["store"] = _store_call(self._store, "GET", "stats")
      if self._metrics:
        self._out["metrics_end"] = _scrape_window(self._metrics)
    close = getattr(self._it, "close", None)
    if close:
      close()

  def __getattr__(self, name: str) -> Any:  # get_state, set_state, stats
    return getattr(self._it, name)


def _scrape_window(address: str) -> dict[str, float]:
  """What a server made and where it read it, so far: the window's edges."""
  m = top.scrape(address, timeout_s=30)

  def total(name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))

  return {"records_served": total("elevator_records_served_total"),
          "tokens_served": total("elevator_tokens_served_total"),
          "held": total("elevator_cache_bytes", of="held"),
          "wanted": total("elevator_cache_bytes", of="wanted"),
          "filled": total("elevator_cache_filled_bytes_total")}


def measure_probed(spec: dict[str, Any]) -> dict[str, Any]:
  """consume.py's run of `spec`, its first iterator seen by a _Probe (in the
  measurement's own forked process: what is patched here dies with it).
  A whole-shard source with a shuffle window is read in its own order."""
  from grain_elevator.tools.bench import consume  # pylint: disable=g-import-not-at-top
  out: dict[str, Any] = {}
  made = [0]

  def probed(maker: Callable[[dict[str, Any]], Callable[[], Any]]
             ) -> Callable[[dict[str, Any]], Callable[[], Any]]:
    def build(s: dict[str, Any]) -> Callable[[], Any]:
      make = maker(s)

      def make_probed() -> Any:
        made[0] += 1
        it = make()
        return _Probe(it, spec, out) if made[0] == 1 else it
      return make_probed
    return build

  consume._grain_local = probed(consume._grain_local)  # pylint: disable=protected-access
  consume._elevator = probed(consume._elevator)  # pylint: disable=protected-access
  source = spec.get("bucket_source") or {}
  if source.get("window_fraction"):
    import grain  # pylint: disable=g-import-not-at-top
    from grain_elevator.tools.bench import bucket_sources  # pylint: disable=g-import-not-at-top
    grain.MapDataset.shuffle = lambda self, *a, **k: self  # the source's own order

    def windowed(s: dict[str, Any]) -> Any:
      os.environ.update(s["env"])
      return bucket_sources.ShardCacheSource(
          s["urls"], tempfile.mkdtemp(dir=s["cache_root"]), s["limit_bytes"],
          window_fraction=s["window_fraction"], seed=1)
    consume._bucket_source = windowed  # pylint: disable=protected-access
  result = consume.run(spec)
  result["probe"] = out
  return result


# -- the bench ------------------------------------------------------------------------


def _med(values: list[float | None]) -> float | None:
  vals = [v for v in values if v is not None]
  return statistics.median(vals) if vals else None


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
  return {k: after[k] - before.get(k, 0.0) for k in after}


def _derive(setup: Setup, s: harness.System, r: dict[str, Any], record_bytes: float,
            counts: dict[str, float] | None) -> dict[str, Any]:
  """A run's figures from its probe (the store over the window) and the
  server's counts over the run."""
  p = r.get("probe") or {}
  out = {**r, "records_window": None}
  begin, end = p.get("metrics_begin"), p.get("metrics_end")
  made = _delta(end, begin) if begin and end else None  # what the server made in the window
  if setup.text:
    per = setup.tokens_per_record
    tokens = made["tokens_served"] if made else p.get("tokens", 0)
    docs = tokens / per if per else 0
    out["documents_per_s"] = r["tokens_per_s"] / per if per else None
  else:
    docs = made["records_served"] if made else p.get("records", 0)
    out["documents_per_s"] = r["records_per_s"]
  out["records_window"] = docs
  st = p.get("store")
  if st and s.key != "local" and docs:
    window = st["window_s"]
    delivered = docs * record_bytes
    out.update(
        gets=st["requests"], gets_per_record=st["requests"] / docs,
        amplification=st["body_bytes"] / delivered,
        cost_per_tb=st["requests"] / delivered * 1e12 * GET_PRICE,
        in_flight_mean=st["in_flight_mean"], in_flight_peak=st["in_flight_peak"],
        store_gets_per_s=st["requests"] / window,
        store_answered_per_s=sum(v for k, v in st["statuses"].items()
                                 if k.startswith("2")) / window,
        refused=st["refused"], store_cores=st["window_cpu_s"] / window,
        store_latency_s=(st["in_flight_mean"] * window / st["requests"]
                         if st["requests"] else None),
        ttfb_mean_s=st["ttfb_sum_s"] / st["ttfb_draws"] if st["ttfb_draws"] else None)
  if r.get("server_cores") is not None and out["documents_per_s"]:
    out["server_cpu_s_per_record"] = r["server_cores"] / out["documents_per_s"]
  if counts is not None:
    out["server"] = counts
    if counts["needed"]:
      out["server_amplification"] = counts["fetched"] / counts["needed"]
    seen = counts["cache_hit"] + counts["cache_miss"]
    if seen:
      out["cache_hit_ratio"] = counts["cache_hit"] / seen
  for edge in ("metrics_begin", "metrics_end"):
    m = p.get(edge)
    if m and m.get("wanted"):  # filled, not held: the held gauge counts fills under way
      out[f"cache_held_{edge.split('_')[1]}"] = m["filled"] / m["wanted"]
  return out


FIGURES = ("records_per_s", "tokens_per_s", "documents_per_s", "client_cores", "server_cores",
           "server_cpu_s_per_record", "gets_per_record", "amplification", "cost_per_tb",
           "in_flight_mean", "in_flight_peak", "store_gets_per_s", "store_answered_per_s",
           "refused", "store_cores", "store_latency_s", "ttfb_mean_s", "server_amplification",
           "cache_hit_ratio", "cache_held_begin", "cache_held_end", "first_batch_s",
           "resume_first_batch_s")


def _wait_filled(server: LocalServer, port: int) -> dict[str, float]:
  """Until the cache holds every object the server reads: held == wanted
  (its gauge counts fills under way) and every wanted byte filled, or, where the held gauge stops short though every wanted byte was filled
  (`elevator_cache_filled_bytes_total`) for HELD_GRACE_S, that (noted as
  `held_short`). Its counts then, and the seconds it took."""
  began = time.perf_counter()
  deadline = began + FILL_TIMEOUT_S
  filled_at = None
  while True:
    c = server_counts(port)
    now = time.perf_counter()
    if c["wanted"] and c["held"] >= c["wanted"] and c["filled"] >= c["wanted"]:
      return {**c, "fill_s": now - began}
    if c["wanted"] and c["filled"] >= c["wanted"]:
      filled_at = filled_at or now
      if now - filled_at >= HELD_GRACE_S:
        return {**c, "fill_s": filled_at - began, "held_short": c["wanted"] - c["held"]}
    if now > deadline:
      raise RuntimeError(f"the cache did not fill in {FILL_TIMEOUT_S:.0f} s: held "
                         f"{c['held']:.0f} of {c['wanted']:.0f} bytes, filled {c['filled']:.0f}"
                         f"\n{server.stderr()[-2000:]}")
    time.sleep(0.2)


def run_setup(setup: Setup, root: pathlib.Path, *, workers: int, repeats: int, seconds: float,
              warmup_s: float, settings: StoreSettings = StoreSettings(),
              bare: bool = False) -> dict[str, Any]:
  """Every system `repeats` times, interleaved, against the stand-in store
  holding `setup`'s shards; the report's workload entry."""
  from grain_elevator.tools.bench import store_rate  # pylint: disable=g-import-not-at-top
  name = setup.name
  label = f"{name}/s3"
  files = setup.files
  workloads_lib.warm_page_cache(files)
  data_bytes = sum(os.path.getsize(f) for f in files)
  servers: dict[str, LocalServer] = {}
  ports: dict[str, int] = {}
  entry: dict[str, Any] = {}
  with bucket_copy(name, files, root, settings) as (store, urls, env), \
      tempfile.TemporaryDirectory(prefix="elevator-bench-cache-", dir=root) as cache_root:
    num, stored = stored_bytes(urls, env)
    record_bytes = stored / num
    harness.log(f"[{label}] the store's ceiling ({record_bytes:,.0f} B ranged GETs) ...")
    ceiling = store_rate.ceiling("s3", seconds=2.0, size=max(1, round(record_bytes)))
    harness.log(f"[{label}] the store answers {ceiling['gets_per_s']:,.0f} GETs/s")
    bucket_config = str(bucket_config_of(setup.config, name))
    windowed = os.path.join(cache_root, "windowed")
    os.makedirs(windowed)
    window_limit = int(data_bytes * 2 * WINDOW_FRACTION
                       + 2 * max(os.path.getsize(f) for f in files))
    cold: dict[str, Any] = {}
    try:
      ports["local"] = free_port()
      servers["local"] = LocalServer(setup.config, workers=workers, extra_args=[
          *SERVE_ARGS, "--metrics-port", str(ports["local"])])
      ports["bucket"] = free_port()
      servers["bucket"] = LocalServer(bucket_config, workers=workers, env=env, extra_args=[
          *SERVE_ARGS, "--metrics-port", str(ports["bucket"])])
      ports["cache_warm"] = free_port()
      servers["cache_warm"] = LocalServer(bucket_config, workers=workers, env=env, extra_args=[
          *SERVE_ARGS, "--metrics-port", str(ports["cache_warm"]),
          "--cache-dir", os.path.join(cache_root, "warm")])
      harness.log(f"[{label}] filling the warm cache ...")
      filled = _wait_filled(servers["cache_warm"], ports["cache_warm"])
      harness.log(f"[{label}] the warm cache holds {filled['held'] / 2**20:,.0f} MiB "
                  f"({filled['fill_s']:.1f} s)")
      base = {"store_url": store.url, **({"pace": settings.pace} if settings.pace else {})}
      service = {**setup.service, **base}
      systems = [
          harness.System("bucket", f"service W={workers}, bucket, reads by plan (default)", {
              **service, "target": servers["bucket"].target,
              "server_pids": [servers["bucket"].proc.pid]}, "service"),
          harness.System("cache_cold", f"service W={workers}, bucket, cache cold (first epoch, "
                         "empty --cache-dir)", {**service}, "service"),
          harness.System("cache_warm", f"service W={workers}, bucket, cache warm (filled)", {
              **service, "target": servers["cache_warm"].target,
              "server_pids": [servers["cache_warm"].proc.pid]}, "service"),
          harness.System("grain_per_record", f"local Grain, per-record reads, {GRAIN_THREADS} "
                         "threads", {**setup.grain, **base, "bucket_source": {
                             "kind": "per_record", "urls": urls, "env": env}}, "grain"),
          harness.System("grain_shards", f"local Grain, whole shards, windowed shuffle "
                         f"({WINDOW_FRACTION:.0%} of data)", {
                             **setup.grain, **base, "bucket_source": {
                                 "kind": "shard_cache", "urls": urls, "env": env,
                                 "limit_bytes": window_limit, "cache_root": windowed,
                                 "window_fraction": WINDOW_FRACTION}}, "grain"),
          harness.System("local", f"service W={workers}, local files", {
              **service, "target": servers["local"].target,
              "server_pids": [servers["local"].proc.pid]}, "service"),
      ]
      raw: dict[str, list[dict[str, Any]]] = {s.key: [] for s in systems}
      bare_runs: list[dict[str, Any]] = []
      ranges = record_ranges(urls, env) if bare else []
      total, done = repeats * len(systems), 0
      for rep in range(repeats):
        for s in systems:
          images.wait_idle([sv.proc.pid for sv in servers.values()])
          spec = dict(s.spec)
          port = ports.get(s.key)
          if s.key == "cache_cold":  # a fresh server, an empty folder
            port = free_port()
            cold["dir"] = tempfile.mkdtemp(prefix="cold-", dir=cache_root)
            cold["server"] = LocalServer(bucket_config, workers=workers, env=env, extra_args=[
                *SERVE_ARGS, "--metrics-port", str(port), "--cache-dir", cold["dir"]])
            spec.update(target=cold["server"].target, server_pids=[cold["server"].proc.pid])
          if port:
            spec["probe_metrics"] = f"127.0.0.1:{port}"
          before = server_counts(port) if port else None
          try:
            r = harness.forked(measure_probed, {**spec, "seconds": seconds,
                                                "warmup_s": warmup_s}, s.label)
            counts = _delta(server_counts(port), before) if port else None
          finally:
            if cold.get("server") is not None:
              cold.pop("server").stop()
              shutil.rmtree(cold.pop("dir"), ignore_errors=True)
            for d in os.listdir(windowed):
              shutil.rmtree(os.path.join(windowed, d), ignore_errors=True)
          r = _derive(setup, s, r, record_bytes, counts)
          raw[s.key].append(r)
          done += 1
          figure = "tokens_per_s" if setup.text else "records_per_s"
          extra = (f"  {r['gets_per_record']:.3f} GETs/rec, {r['in_flight_mean']:.0f} in flight"
                   if r.get("gets_per_record") is not None else "")
          harness.log(f"[{label}] {done:3d}/{total} rep {rep + 1}: {s.label:<62} "
                      f"{r[figure]:>10,.0f} {'tok' if setup.text else 'rec'}/s{extra}")
        if bare:
          images.wait_idle([sv.proc.pid for sv in servers.values()])
          b = harness.forked(store_rate.bare_reads, {
              "env": env, "url": store.url, "bucket": BUCKET, "ranges": ranges,
              "in_flight": BARE_IN_FLIGHT, "seconds": seconds, "warmup_s": warmup_s},
              "bare obstore reader")
          b.pop("store", None)
          bare_runs.append(b)
          harness.log(f"[{label}] rep {rep + 1}: bare obstore reader {b['gets_per_s']:,.0f} "
                      f"GETs/s, {b['cpu_s_per_get'] * 1e6:.0f} us CPU/GET")
    finally:
      if cold.get("server") is not None:
        cold["server"].stop()
      for server in servers.values():
        server.stop()
  entry.update(
      kind="storage_text" if setup.text else "storage", ttfb_ms=list(settings.ttfb_ms),
      max_rate=settings.max_rate, pace=settings.pace, records=num, shards=len(files),
      shard_bytes=round(data_bytes / len(files)), record_bytes=round(record_bytes),
      global_batch_size=setup.global_batch_size, workers=workers,
      window_fraction=WINDOW_FRACTION, ceiling=ceiling, warm_fill=filled,
      tokens_per_record=setup.tokens_per_record or None,
      systems=harness.rows(systems, raw, FIGURES))
  if bare:
    entry["bare"] = {"in_flight": BARE_IN_FLIGHT, "runs": bare_runs,
                     "cpu_s_per_get": harness.summary([b["cpu_s_per_get"] for b in bare_runs]),
                     "gets_per_s": harness.summary([b["gets_per_s"] for b in bare_runs])}
  return entry


def setup_of(root: pathlib.Path, name: str, workers: int, records: int | None = None,
             global_batch_size: int = 0) -> Setup:
  """The small or image workload written (unless it is) in shards of ~SHARD_BYTES."""
  w = workloads_lib.at_batch_size(workloads_lib.WORKLOADS[name], global_batch_size)
  n = records or RECORDS[name]
  data = root / "buckets"
  shards = shard_count(n, w.record_bytes)
  harness.log(f"[{name}/s3] preparing {n:,} records in {shards} shards in {data / name} ...")
  if len(workloads_lib.shard_files(data, w)) != shards:  # written for another count
    for marker in (data / name).glob(".complete-*"):
      marker.unlink()
  config = workloads_lib.prepare(data, w, n, num_shards=shards)
  base = {"workload": w.name, "global_batch_size": w.global_batch_size}
  return Setup(
      name=name, text=False, config=config, files=workloads_lib.shard_files(data, w),
      global_batch_size=w.global_batch_size,
      service={**base, "system": "service", "dataset": w.name, "client": _client(w, workers)},
      grain={**base, "system": "grain", "options": w.options, "threads": GRAIN_THREADS,
             "mp_workers": 0, "files": [], **({"pipeline": "image"} if w.kind == "image" else {})})


def run_workload(root: pathlib.Path, name: str, *, workers: int, repeats: int, seconds: float,
                 warmup_s: float, settings: StoreSettings = StoreSettings(),
                 records: int | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  """Every system `repeats` times, interleaved; the report's workload entry.
  `global_batch_size`: G instead of the workload's own (0: its own)."""
  setup = setup_of(root, name, workers, records, global_batch_size)
  return run_setup(setup, root, workers=workers, repeats=repeats, seconds=seconds,
                   warmup_s=warmup_s, settings=settings, bare=name in BARE_WORKLOADS)


def run(root: pathlib.Path, workload_names: list[str], *, workers: int, repeats: int,
        seconds: float, warmup_s: float, settings: StoreSettings = StoreSettings(),
        records: dict[str, int] | None = None, global_batch_size: int = 0) -> dict[str, Any]:
  import sys  # pylint: disable=g-import-not-at-top
  for name in workload_names:
    if name not in WORKLOADS:
      raise ValueError(f"--storage s3 runs the workloads {', '.join(WORKLOADS)}, not {name!r}")
  report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                        "load_before": list(os.getloadavg())},
                            "repeats": repeats, "seconds": seconds, "storage": "s3",
                            "settings": dataclasses.asdict(settings), "workloads": {}}
  began = time.perf_counter()
  for name in workload_names:
    if name == "text":
      from grain_elevator.tools.bench import bucket_text  # pylint: disable=g-import-not-at-top
      report["workloads"][name] = bucket_text.run_workload(
          root, workers=workers, repeats=repeats, seconds=seconds, warmup_s=warmup_s,
          settings=settings, documents=(records or {}).get(name) or None,
          global_batch_size=global_batch_size)
      continue
    report["workloads"][name] = run_workload(
        root, name, workers=workers, repeats=repeats, seconds=seconds, warmup_s=warmup_s,
        settings=settings, records=(records or {}).get(name) or None,
        global_batch_size=global_batch_size)
  report["wall_s"] = time.perf_counter() - began
  report["machine"]["load_after"] = list(os.getloadavg())
  return report


# -- the report -------------------------------------------------------------------------


def _verdict(value: float, goal: float, at_least: bool) -> str:
  """"met", or by how much not."""
  if (value >= goal) if at_least else (value <= goal):
    return "met"
  return f"not met, {abs(value - goal) / goal:.0%} {'short' if at_least else 'over'}"


def _median(row: dict[str, Any] | None, fig: str) -> float | None:
  s = (row or {}).get(fig)
  return s["median"] if s else None


def goals(wl: dict[str, Any]) -> list[str]:
  """Each goal this run can judge, met or by how much not, and which it cannot."""
  rows = wl["systems"]
  fig = "tokens_per_s" if wl["kind"] == "storage_text" else "records_per_s"
  rate = lambda key: _median(rows.get(key), fig)  # noqa: E731
  out, unjudged = [], []
  local, plan = rate("local"), rate("bucket")
  if rate("cache_warm") and local:
    v = rate("cache_warm") / local
    out.append(f"cache warm {v:.2f}× local files (goal ≥ 0.8: {_verdict(v, 0.8, True)})")
  if rate("cache_cold") and plan:
    v = rate("cache_cold") / plan
    out.append(f"cache cold, first epoch {v:.2f}× by plan (goal ≥ 1: {_verdict(v, 1.0, True)})")
  bare = (wl.get("bare") or {}).get("cpu_s_per_get")
  cpu_plan = _median(rows.get("bucket"), "server_cpu_s_per_record")
  cpu_local = _median(rows.get("local"), "server_cpu_s_per_record")
  if bare and cpu_plan is not None and cpu_local is not None:
    read = cpu_plan - cpu_local
    v = read / bare["median"]
    out.append(f"server CPU per record read from the bucket {read * 1e6:,.0f} us (by plan "
               f"{cpu_plan * 1e6:,.0f} − local files {cpu_local * 1e6:,.0f}) = {v:.2f}× the "
               f"bare obstore reader's {bare['median'] * 1e6:,.0f} us per GET (goal ≤ 1.5: "
               f"{_verdict(v, 1.5, False)})")
  else:
    unjudged.append("CPU per record vs bare obstore (image workload)")
  if wl.get("pace") and plan:
    pace = wl["pace"]
    per_s = _median(rows["bucket"], "records_per_s")
    v = per_s / pace
    attainable = min(pace, _median(rows["local"], "records_per_s") or pace)
    out.append(f"distant bucket: by plan {per_s:,.0f} records/s = {v:.2f}× the pace of "
               f"{pace:,.0f} (goal ≥ 0.95: {_verdict(v, 0.95, True)}); "
               f"{per_s / attainable:.2f}× the {attainable:,.0f}/s this machine's local files "
               "reach under that pace")
    latency = _median(rows["bucket"], "store_latency_s")
    gets = _median(rows["bucket"], "gets_per_record")
    mean = _median(rows["bucket"], "in_flight_mean")
    if latency and gets and mean is not None:
      need = pace * gets * latency
      v = mean / need
      out.append(f"distant bucket: {mean:.0f} requests in flight (mean; peak "
                 f"{_median(rows['bucket'], 'in_flight_peak'):.0f}) vs Little's law's pace × "
                 f"GETs/record × the store's mean latency = {pace:,.0f} × {gets:.3f} × "
                 f"{latency * 1e3:.0f} ms = {need:.0f} (goal ≥ 0.8×: {v:.2f}, "
                 f"{_verdict(v, 0.8, True)}); at the {per_s:,.0f}/s reached it asks "
                 f"{per_s * gets * latency:.0f} ({mean / (per_s * gets * latency):.2f}×)")
  else:
    unjudged.append("distant bucket (--pace)")
  amp = _median(rows.get("bucket"), "amplification")
  if amp is not None:
    own = _median(rows["bucket"], "server_amplification")
    own_s = f"; its own fetched ÷ needed {own:.2f}" if own is not None else ""
    out.append(f"read amplification by plan {amp:.2f}× (store bytes ÷ records taken{own_s}) "
               f"(goal ≤ 1.1: {_verdict(amp, 1.1, False)})")
  if plan and rate("grain_per_record"):
    v = plan / rate("grain_per_record")
    out.append(f"by plan {v:.1f}× local Grain's per-record reads (goal ≥ 5: "
               f"{_verdict(v, 5.0, True)})")
  if wl.get("max_rate") and plan:
    allowed = wl["max_rate"]
    answered = _median(rows["bucket"], "store_answered_per_s")
    refused = _median(rows["bucket"], "refused")
    asked = _median(rows["local"], "records_per_s") * (_median(rows["bucket"], "gets_per_record")
                                                       or 0)
    v = answered / allowed
    bind = "" if asked > allowed else (f" (the cap does not bind: local files' rate × GETs/record "
                                       f"asks only ~{asked:,.0f}/s)")
    out.append(f"throttled at {allowed:,.0f} requests/s: by plan {answered:,.0f} GETs/s answered "
               f"= {v:.2f}× the allowed rate, {refused:,.0f} refused a run (median){bind} "
               f"(goal ≥ 0.9: {_verdict(v, 0.9, True)})")
  else:
    unjudged.append("throttled (--storage-max-rate)")
  if unjudged:
    out.append("not judged in this run: " + "; ".join(unjudged))
  return out


def _f(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 0) -> str:
  s = row.get(key)
  if s is None:
    return "n/a"
  if s["min"] == s["max"]:
    return f"{s['median'] * scale:,.{digits}f}"
  return harness.fmt(s, scale, digits)


def _mib(n: float) -> str:
  return f"{n / 2**20:,.{0 if n >= 10 * 2**20 else 1}f}"


def table(name: str, wl: dict[str, Any], repeats: int) -> list[str]:
  rows = wl["systems"]
  text = wl["kind"] == "storage_text"
  fig, unit = ("tokens_per_s", "tokens/s") if text else ("records_per_s", "records/s")
  local = rows["local"][fig]["median"]
  p50, p99 = wl["ttfb_ms"]
  what = (f"{wl['records']:,} documents ({wl['record_bytes']:,} B stored, "
          f"{wl['tokens_per_record']:,.0f} tokens each)" if text else
          f"{wl['records']:,} records of {wl['record_bytes']:,} B stored")
  extra = "".join([f", the store refuses past {wl['max_rate']:,.0f} requests/s a prefix"
                   if wl.get("max_rate") else "",
                   f", the trainer paced at {wl['pace']:,.0f} {'rows' if text else 'records'}/s"
                   if wl.get("pace") else ""])
  c = wl["ceiling"]
  rec = "document" if text else "record"
  lines = [f"### {name} from the stand-in S3 store (time to first byte p50 {p50:g} ms, p99 "
           f"{p99:g} ms{extra}): {what}, {wl['shards']} shards of "
           f"{_mib(wl['shard_bytes'])} MiB, G={wl['global_batch_size']}; median "
           f"(min–max) of {repeats} interleaved runs; GET cost at list price, $0.0004 per 1,000 "
           "GETs", "",
           f"The store answers {c['gets_per_s']:,.0f} GETs/s here ({c['size']:,} B ranged GETs, "
           f"{c['in_flight']} in flight, no time to first byte; "
           f"{c['store_cpu_s_per_get'] * 1e6:.0f} us of its CPU a GET), so figures below it "
           "measure the reader.", "",
           f"| system | {unit} | × local files | server cores | trainer cores | "
           f"GETs/{rec} | read amplification | GET $/TB delivered | store in flight mean "
           "(peak) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows.values():
    bucket = r.get("in_flight_mean") is not None
    in_flight = (f"{r['in_flight_mean']['median']:,.1f} ({r['in_flight_peak']['median']:,.0f})"
                 if bucket else "n/a")
    lines.append(
        f"| {r['label']} | {_f(r, fig)} | {r[fig]['median'] / local:.2f} | "
        f"{_f(r, 'server_cores', digits=2)} | {_f(r, 'client_cores', digits=2)} | "
        f"{_f(r, 'gets_per_record', digits=4)} | {_f(r, 'amplification', digits=2)} | "
        f"{_f(r, 'cost_per_tb', digits=2)} | {in_flight} |")
  return lines + [""] + [f"- {n}" for n in notes(wl)] + [f"- {g}" for g in goals(wl)] + [""]


def notes(wl: dict[str, Any]) -> list[str]:
  """What the table's figures rest on: the store's view of the by-plan
  server, the server's own counts, the caches, the bare reader."""
  rows = wl["systems"]
  out = []
  plan = rows.get("bucket")
  if plan and plan.get("store_gets_per_s"):
    runs = plan["runs"]
    srv = lambda k: _med([(r.get("server") or {}).get(k) for r in runs]) or 0.0  # noqa: E731
    def ms(fig: str) -> str:  # a short run's store may have timed no read
      value = _median(plan, fig)
      return "n/a" if value is None else f"{value * 1e3:.0f} ms"

    out.append(
        f"by plan, at the store: {_median(plan, 'store_gets_per_s'):,.0f} requests/s, mean "
        f"latency {ms('store_latency_s')} (time to first byte "
        f"{ms('ttfb_mean_s')}), {_median(plan, 'refused') or 0:,.0f} refused, "
        f"the store's CPU {_median(plan, 'store_cores') or 0:.2f} cores; the server's GETs a run: "
        f"{srv('gets_answered'):,.0f} answered, {srv('gets_refused'):,.0f} refused, "
        f"{srv('gets_retried'):,.0f} retried, {srv('gets_hedged'):,.0f} hedged, "
        f"{srv('gets_failed'):,.0f} failed; CPU "
        f"{_median(plan, 'server_cpu_s_per_record') * 1e6:,.0f} us a record (local files "
        f"{_median(rows['local'], 'server_cpu_s_per_record') * 1e6:,.0f})")
  warm, cold = rows.get("cache_warm"), rows.get("cache_cold")
  if warm and cold:
    f = wl.get("warm_fill") or {}
    short = (f"; its held gauge stayed {f['held_short'] / 2**20:,.0f} MiB short of the "
             f"{f['wanted'] / 2**20:,.0f} MiB wanted though all of it was filled"
             if f.get("held_short") else "")
    out.append(
        f"cache: the warm one filled {f.get('filled', 0) / 2**20:,.0f} MiB in "
        f"{f.get('fill_s', 0):.1f} s before its runs{short}, hit ratio "
        f"{(_median(warm, 'cache_hit_ratio') or 0):.3f}; the cold one had filled "
        f"{(_median(cold, 'cache_held_begin') or 0):.0%} of the data when the window began and "
        f"{(_median(cold, 'cache_held_end') or 0):.0%} when it ended (hit ratio "
        f"{(_median(cold, 'cache_hit_ratio') or 0):.3f})")
  bare = wl.get("bare")
  if bare:
    out.append(f"bare obstore reader, same store, same records' ranges, {bare['in_flight']} in "
               f"flight: {harness.fmt(bare['gets_per_s'])} GETs/s, "
               f"{harness.fmt(bare['cpu_s_per_get'], 1e6)} us CPU a GET")
  return out
