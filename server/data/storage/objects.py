"""Objects through obstore: globs listed, identities read, byte ranges
fetched concurrently and pinned to the object's recorded version.

Every read of a served object is conditional: `If-Match` on its recorded
ETag, or on GCS its recorded generation (`generation=`), so a replaced
object answers 412 or 404, never other bytes. Listing and HEADs go
through obstore's own retries; the serving reads retry here, so that each
transient error is seen: a read that fails with a 5xx, 429, reset or stall
is asked again with backoff and jitter for the dataset's retry budget
(settings.py), a 503 SlowDown or 429 also halving its prefix's window
(throttle.py); past the budget it fails ServiceUnavailableError
(UNAVAILABLE) naming the object, which a client retries. An answer that
is not the range asked for (a 200 with the whole object, another range's
Content-Range, no Content-Length, fewer bytes, or more: the body is read as
a stream and let go of at the asked length + 1, so a long one is never held)
is DataLossError (DATA_LOSS) naming the object and what was wrong, not
retried: the store itself, or a proxy before it, is broken. A read still
missing past the p95 of recent reads is asked again and the first answer
wins (HEDGE_SHARE). Messages name the URL and the HTTP status, never a
response body or a credential.

Fetches run on one event loop per process (a daemon thread): a batch's
ranges over all its shards go out together, and the read-ahead's
(read_ahead.py) beside them, as many at once as Little's law asks for the
rate they are asked at and their measured latency (latency.py). Each
request's time and outcome are reported to `counts` (the server's metrics;
nothing by default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import random
import re
import resource
import threading
import time
from typing import Any, Sequence

from grain_elevator.proto.errors import (ConfigError, DataLossError, ServiceUnavailableError,
                                         ShardChangedError)
from grain_elevator.server.data.storage import latency as latency_lib
from grain_elevator.server.data.storage import settings as settings_lib
from grain_elevator.server.data.storage import throttle
from grain_elevator.server.data.storage import urls
from grain_elevator.server.data.storage.settings import StorageSettings

# Range reads in flight at once in one process (a worker) follow Little's
# law (latency.py: the rate reads are asked for x their p99, twice over),
# within these bounds: a bucket answers in ~20-50 ms whatever the size up to
# a few MB, so at least MIN_IN_FLIGHT keep a worker's reads going at its
# bandwidth; at most MAX_IN_FLIGHT connections (and half the process's file
# descriptors) are open. The read-ahead's budget bounds their bytes.
MIN_IN_FLIGHT = 128
MAX_IN_FLIGHT = 2048
# Of those, reads made ahead of need (read_ahead.py) hold at most this share:
# the rest are kept for the reads of the step being made now.
AHEAD_SHARE = 0.75
# A read that fails transiently (5xx, 429, a reset, a stall past
# request_timeout_s) is asked again after a random wait of up to a backoff
# that doubles from the first to the last, for the dataset's retry budget.
BACKOFF_FIRST_S = 0.1
BACKOFF_LAST_S = 2.0
# Stragglers: a read still missing past the p95 of recent reads is asked
# for again, for at most this share of all reads (AWS advises retrying the
# slowest 1-5%); HEDGE_BURST hedges may go at once after a quiet spell.
HEDGE_SHARE = 0.05
HEDGE_BURST = 16.0
# Objects listed for one glob at most: a prefix that names a whole bucket
# by mistake is refused rather than listed for minutes.
MAX_LISTED = 1_000_000


@dataclasses.dataclass(frozen=True)
class ObjectRef:
  """One object as recorded: what every read of it is pinned to."""

  url: str
  settings: StorageSettings
  size: int
  etag: str | None
  version: str | None  # GCS generation; an S3 version id where versioning is on
  # Whose reads these are, for the metrics (not part of the identity).
  dataset: str = dataclasses.field(default="", compare=False)


class Counts:
  """What storage reads report (the server's metrics implement it): the
  seconds of each ranged request, and each GET's outcome per dataset
  ("answered", "failed", "refused": a 503 or 429; "retried"; "hedged": a
  straggler asked again). Here: nothing."""

  def storage_request(self, seconds: float) -> None:
    pass

  def storage_get(self, dataset: str, outcome: str) -> None:
    pass


_counts: Counts = Counts()


def set_counts(counts: Counts) -> None:
  """Where this process's reads report (a worker: its metrics)."""
  global _counts
  _counts = counts


def _max_in_flight() -> int:
  """MAX_IN_FLIGHT, or half the file descriptors this process may open
  (each read in flight holds a connection)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != resource.RLIM_INFINITY and soft < MAX_IN_FLIGHT * 2:
    try:  # the soft limit is 1024 on most distributions; servers raise it
      wanted = MAX_IN_FLIGHT * 2 if hard == resource.RLIM_INFINITY else min(hard, MAX_IN_FLIGHT * 2)
      resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
      soft = wanted
    except (ValueError, OSError):
      pass
  if soft == resource.RLIM_INFINITY:
    return MAX_IN_FLIGHT
  return max(MIN_IN_FLIGHT, min(MAX_IN_FLIGHT, soft // 2))


class _Failure(Exception):
  """An obstore error, classified: `kind` is one of "missing", "denied",
  "changed", "unavailable", "wrong" (an answer that is not the range asked
  for), "other"; `reason` is safe to show."""

  def __init__(self, kind: str, reason: str, refused: bool = False):
    super().__init__(reason)
    self.kind = kind
    self.reason = reason
    self.refused = refused  # the store said it is asked too fast (503, 429)


_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z][A-Za-z -]*))?")
# object_store's errors for an answer that is not the range asked for (its
# GetResultError, named in the error's debug text): a 200 to a ranged GET,
# another range, a missing or bad Content-Range, Content-Length or ETag.
_WRONG_ANSWER = re.compile(r"source: (NotPartial|UnexpectedRange|NoContentRange|ParseContentRange"
                           r"|InvalidContentRange|InvalidRangeRequest|Header)\b")


def _reason(e: BaseException) -> str:
  """A short reason: the error type, the HTTP status where there was one.
  Never the body or a URL's query (which may carry a signature)."""
  text = str(e)
  m = _STATUS.search(text)
  first = text.split("\n", 1)[0]
  if m:
    out = f"HTTP {m.group(1)}" + (f" {m.group(2).strip()}" if m.group(2) else "")
  else:
    out = re.sub(r"\?\S*", "", first)[:200]
  retries = re.search(r"after (\d+) retries", first)
  if retries:
    out += f", after {retries.group(1)} retries"
  for secret in settings_lib.secret_values():
    out = out.replace(secret, "<redacted>")
  return f"{type(e).__name__}: {out}"


def _classify(e: BaseException) -> _Failure:
  from obstore import exceptions as ox  # pylint: disable=g-import-not-at-top
  reason = _reason(e)
  m = _STATUS.search(str(e))
  status = int(m.group(1)) if m else None
  if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or status in (401, 403):
    return _Failure("denied", reason)
  if isinstance(e, ox.PreconditionError) or status == 412:
    return _Failure("changed", reason)
  if isinstance(e, (ox.NotFoundError, FileNotFoundError)) or status == 404:
    return _Failure("missing", reason)
  if status is None and _WRONG_ANSWER.search(str(e)):
    return _Failure("wrong", reason)
  if status is not None and status < 500 and status != 429:
    return _Failure("other", reason)
  return _Failure("unavailable", reason, refused=status in (429, 503))


class Objects:
  """This process's stores and fetch loop. Thread-safe: the stores are
  guarded by their own lock, the loop is started once under `_lock`."""

  def __init__(self):
    self._stores = settings_lib.Stores()
    self._lock = threading.Lock()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._loop_pid = -1
    self.latency = latency_lib.Latency()
    self._max_in_flight = _max_in_flight()
    # The loop thread's alone (made again in a forked child's loop):
    self._all: throttle.Gate | None = None
    self._ahead: throttle.Gate | None = None
    self._prefixes: dict[str, throttle.Prefix] = {}
    self._hedge_tokens = HEDGE_BURST

  def _store(self, url: str, settings: StorageSettings,
             retries: bool = True) -> tuple[Any, str]:
    scheme, bucket, key = urls.split(url)
    try:
      return self._stores.get(scheme, bucket, settings, retries), key
    except ImportError as e:
      raise ConfigError(f"{url}: reading objects needs obstore (pip install obstore): {e}") from e
    except Exception as e:  # a bad endpoint or region
      raise ConfigError(f"{url}: cannot set up the {scheme}:// client: {_reason(e)}") from e

  def _event_loop(self) -> asyncio.AbstractEventLoop:
    with self._lock:
      if self._loop is None or self._loop_pid != os.getpid():
        loop = _new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="elevator-storage").start()
        self._loop, self._loop_pid = loop, os.getpid()
        self._all = self._ahead = None
        self._prefixes = {}
      return self._loop

  def _run(self, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, self._event_loop()).result()

  # -- at start ----------------------------------------------------------------

  def expand(self, dataset: str, pattern: str, settings: StorageSettings) -> list[str]:
    """The objects a URL glob matches, sorted; ConfigError names the dataset
    and the URL when the bucket cannot be listed or nothing matches."""
    import obstore  # pylint: disable=g-import-not-at-top
    scheme, bucket, key_pattern = urls.split(pattern)
    store, _ = self._store(pattern, settings)
    prefix = urls.glob_prefix(key_pattern)
    regex = urls.glob_regex(key_pattern)
    found: list[str] = []
    try:
      for page in obstore.list(store, prefix=prefix or None, chunk_size=1000):
        for meta in page:
          if regex.match(meta["path"]) and meta["size"] > 0:
            found.append(urls.join(scheme, bucket, meta["path"]))
        if len(found) > MAX_LISTED:
          raise ConfigError(f"dataset {dataset!r}: {pattern} matches over {MAX_LISTED:,} "
                            "objects; name a narrower prefix")
    except ConfigError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise _start_error(dataset, f"{scheme}://{bucket}/{prefix}", _classify(e), "list") from e
    if not found:
      raise ConfigError(f"dataset {dataset!r}: key 'paths': {pattern} matches no objects "
                        f"(listed {scheme}://{bucket}/{prefix})")
    return sorted(found)

  def head(self, url: str, settings: StorageSettings) -> ObjectRef:
    """The object as it is now (raises _Failure)."""
    import obstore  # pylint: disable=g-import-not-at-top
    store, key = self._store(url, settings)
    try:
      meta = obstore.head(store, key)
    except Exception as e:  # pylint: disable=broad-except
      raise _classify(e) from e
    return ObjectRef(url, settings, int(meta["size"]), meta.get("e_tag"), meta.get("version"))

  # -- while serving -------------------------------------------------------------

  def fetch(self, ranges: Sequence[tuple[ObjectRef, int, int]]) -> list[Any]:
    """The bytes [begin, end) of each object (a buffer: bytes or obstore's
    Bytes), fetched concurrently, each read pinned to the object's recorded
    version. Raises ShardChangedError (replaced or deleted),
    ServiceUnavailableError (past the retry budget, or access lost) or
    DataLossError (a short read), naming the object."""
    if not ranges:
      return []
    return self._run(self._fetch_all(ranges, self._where(ranges)))

  def fetch_later(self, ranges: Sequence[tuple[ObjectRef, int, int]],
                  futures: list[concurrent.futures.Future] | None = None
                  ) -> list[concurrent.futures.Future]:
    """`fetch` without waiting: a future of each range's bytes (or of the
    error `fetch` would raise), all requested concurrently from now, behind
    the step's own reads (at most AHEAD_SHARE of the depth)."""
    if futures is None:  # else the caller's, one per range, not yet running
      futures = [concurrent.futures.Future() for _ in ranges]
    if ranges:
      try:
        where = self._where(ranges)
      except Exception as e:  # pylint: disable=broad-except
        for future in futures:  # those waiting on them meet the error, not a hang
          if future.set_running_or_notify_cancel():
            future.set_exception(e)
        return futures
      self._event_loop().call_soon_threadsafe(self._start_ahead, list(ranges), futures, where)
    return futures

  def _where(self, ranges: Sequence[tuple[ObjectRef, int, int]]) -> list[tuple[Any, str]]:
    """Each range's (store, key), looked up once per object of the call."""
    found: dict[tuple[str, StorageSettings], tuple[Any, str]] = {}
    out = []
    for obj, _, _ in ranges:
      where = found.get((obj.url, obj.settings))
      if where is None:
        where = found[(obj.url, obj.settings)] = self._store(obj.url, obj.settings,
                                                             retries=False)
      out.append(where)
    return out

  def _start_ahead(self, ranges: list[tuple[ObjectRef, int, int]],
                   futures: list[concurrent.futures.Future],
                   where: list[tuple[Any, str]]) -> None:
    """In the loop: one task per range, each settling its future."""
    for (obj, begin, end), future, w in zip(ranges, futures, where):
      if future.set_running_or_notify_cancel():
        task = asyncio.ensure_future(self._read(obj, begin, end, w, ahead=True))
        task.add_done_callback(functools.partial(_settle, future))

  async def _fetch_all(self, ranges: Sequence[tuple[ObjectRef, int, int]],
                       where: list[tuple[Any, str]]) -> list[Any]:
    tasks = [asyncio.ensure_future(self._read(*r, w)) for r, w in zip(ranges, where)]
    try:
      return list(await asyncio.gather(*tasks))
    finally:
      for t in tasks:
        t.cancel()

  def _gates(self) -> tuple[throttle.Gate, throttle.Gate]:
    """(all reads, reads ahead of need), their limits following Little's law."""
    if self._all is None:  # made in the loop's thread, which alone uses them
      self._all = throttle.Gate(MIN_IN_FLIGHT)
      self._ahead = throttle.Gate(max(1, int(MIN_IN_FLIGHT * AHEAD_SHARE)))
    depth = self.latency.depth(MIN_IN_FLIGHT, self._max_in_flight)
    if depth != self._all.limit:
      self._all.set_limit(depth)
      self._ahead.set_limit(max(1, int(depth * AHEAD_SHARE)))
    return self._all, self._ahead

  def _prefix(self, obj: ObjectRef) -> throttle.Prefix:
    name = obj.url[:obj.url.rfind("/") + 1]
    prefix = self._prefixes.get(name)
    if prefix is None:
      prefix = self._prefixes[name] = throttle.Prefix()
    return prefix

  async def _read(self, obj: ObjectRef, begin: int, end: int, where: tuple[Any, str],
                  ahead: bool = False) -> Any:
    """One range: retried with backoff and jitter while the retry budget
    lasts (a 503 or 429 also narrows its prefix's window), its straggler
    asked again (`_hedged`)."""
    self.latency.asked()
    all_reads, ahead_reads = self._gates()
    prefix = self._prefix(obj)
    deadline = time.monotonic() + obj.settings.retry_s
    backoff = BACKOFF_FIRST_S
    if ahead:
      await ahead_reads.acquire()
    try:
      while True:
        try:
          data = await self._hedged(obj, begin, end, where, all_reads, prefix)
          break
        except _Failure as failure:
          wait = random.uniform(0, backoff)
          if failure.kind != "unavailable" or time.monotonic() + wait > deadline:
            raise serving_error(obj, begin, failure, end) from None
          if failure.refused:
            prefix.refused()
          _counts.storage_get(obj.dataset, "retried")
          await asyncio.sleep(wait)
          backoff = min(BACKOFF_LAST_S, backoff * 2)
    finally:
      if ahead:
        ahead_reads.release()
    if len(data) != end - begin:
      raise DataLossError(f"object {obj.url}: a read of bytes [{begin}, {end}) returned "
                          f"{len(data)} bytes")
    return data

  async def _hedged(self, obj: ObjectRef, begin: int, end: int, where: tuple[Any, str],
                    gate: throttle.Gate, prefix: throttle.Prefix) -> Any:
    """One GET; if it is not back past the p95 of recent reads, the same GET
    again (within HEDGE_SHARE of all GETs), and the first answer wins."""
    tasks = [asyncio.ensure_future(self._get(obj, begin, end, where, gate, prefix))]
    try:
      if end - begin > latency_lib.SAMPLED_BYTES:
        return await tasks[0]
      self._hedge_tokens = min(HEDGE_BURST, self._hedge_tokens + HEDGE_SHARE)
      done, _ = await asyncio.wait(tasks, timeout=self.latency.quantile(95))
      if done or self._hedge_tokens < 1:
        return await tasks[0]
      self._hedge_tokens -= 1
      _counts.storage_get(obj.dataset, "hedged")
      tasks.append(asyncio.ensure_future(self._get(obj, begin, end, where, gate, prefix)))
      pending = set(tasks)
      while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in sorted(done, key=lambda t: t.exception() is not None):  # answers first
          if task.exception() is None or not pending:
            return task.result()
    finally:  # the loser, or both where this read was cancelled
      for task in tasks:
        if not task.done():
          task.cancel()
        elif not task.cancelled():
          task.exception()  # seen: not "never retrieved"

  async def _get(self, obj: ObjectRef, begin: int, end: int, where: tuple[Any, str],
                 gate: throttle.Gate, prefix: throttle.Prefix) -> Any:
    """One ranged GET, no retries (raises _Failure), holding a slot of the
    depth and of its prefix's window."""
    import obstore  # pylint: disable=g-import-not-at-top
    store, key = where
    options: dict[str, Any] = {"range": (begin, end)}
    if obj.version is not None and obj.url.startswith("gs://"):
      options["version"] = obj.version  # GCS: the generation, pinned
    elif obj.etag is not None:
      options["if_match"] = obj.etag
    elif obj.version is not None:
      options["version"] = obj.version
    await prefix.gate.acquire()  # first: a narrowed prefix holds no slot of the others'
    try:
      await gate.acquire()
      try:
        began = time.perf_counter()
        try:
          result = await obstore.get_async(store, key, options=options)
          data = await _body(result, end - begin)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
          raise
        except _Failure:
          _counts.storage_get(obj.dataset, "failed")
          raise
        except BaseException as e:  # pylint: disable=broad-except
          # BaseException: a panic in obstore's Rust is pyo3's PanicException,
          # which is not an Exception; it is transient like a reset (retried).
          failure = _classify(e)
          _counts.storage_get(obj.dataset, "refused" if failure.refused else "failed")
          raise failure from e
        seconds = time.perf_counter() - began
      finally:
        gate.release()
    finally:
      prefix.gate.release()
    prefix.answered(gate.limit)
    self.latency.record(seconds, end - begin)
    _counts.storage_request(seconds)
    _counts.storage_get(obj.dataset, "answered")
    return data


async def _body(result: Any, size: int) -> Any:
  """The answer's body, read as a stream and let go of at `size` + 1
  bytes (a network read's worth past it at most): an answer longer than
  the range asked for raises _Failure ("wrong") without being held whole.
  A body of `size` bytes comes back as one chunk (no copy to join)."""
  chunks = []
  got = 0
  async for chunk in result.stream(min_chunk_size=size + 1):
    chunks.append(chunk)
    got += len(chunk)
    if got > size:
      raise _Failure("wrong", f"the answer ran on past the {size} bytes asked for")
  if len(chunks) == 1:
    return chunks[0]
  return b"".join(chunks)


def _new_event_loop() -> asyncio.AbstractEventLoop:
  """asyncio's own loop. uvloop's costs less a GET, but a clean-clone run
  with it hung in a session server's stop (a supervisor thread never
  joined): not used until that is understood."""
  return asyncio.new_event_loop()


def _settle(future: concurrent.futures.Future, task: asyncio.Task) -> None:
  if task.cancelled():
    future.set_exception(concurrent.futures.CancelledError())
  elif task.exception() is not None:
    future.set_exception(task.exception())
  else:
    future.set_result(task.result())


def serving_error(obj: ObjectRef, begin: int, failure: _Failure,
                  end: int | None = None) -> Exception:
  """What a failed read while serving raises."""
  if failure.kind in ("changed", "missing"):
    return ShardChangedError(
        f"shard {obj.url} changed since the server started (its "
        f"{'generation' if obj.url.startswith('gs://') else 'ETag'} no longer matches: "
        f"{failure.reason}): restart the server to serve the new data; the stream "
        "fingerprint will change")
  if failure.kind == "unavailable":
    return ServiceUnavailableError(
        f"object {obj.url}: storage did not answer a read at byte {begin} within the retry "
        f"budget of {obj.settings.retry_s:g}s ({failure.reason}); the client retries the step")
  if failure.kind == "denied":
    return ServiceUnavailableError(f"object {obj.url}: access denied at byte {begin} "
                                   f"({failure.reason}): have the credentials expired?")
  if failure.kind == "wrong":
    asked = f"bytes [{begin}, {end})" if end is not None else f"byte {begin}"
    return DataLossError(f"object {obj.url}: storage answered a read of {asked} with something "
                         f"else ({failure.reason}); not retried: check the store, or the proxy "
                         "before it")
  return DataLossError(f"object {obj.url}: a read at byte {begin} failed ({failure.reason})")


def _start_error(dataset: str, url: str, failure: _Failure, what: str) -> ConfigError:
  """What a failure at start-up raises: ConfigError naming the dataset and URL."""
  hint = {
      "missing": "the bucket or object does not exist",
      "denied": "access denied: check the credentials (AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, GCS application default credentials) and their rights",
      "unavailable": "storage did not answer within the retry budget",
  }.get(failure.kind, "the request failed")
  return ConfigError(f"dataset {dataset!r}: cannot {what} {url}: {hint} ({failure.reason})")


def start_error(dataset: str, url: str, e: BaseException, what: str) -> ConfigError:
  return _start_error(dataset, url, e if isinstance(e, _Failure) else _classify(e), what)


_objects: Objects | None = None
_objects_lock = threading.Lock()


def store_of(url: str, settings: StorageSettings | None = None) -> tuple[Any, str]:
  """(obstore store, key) of `url`, configured as the server's reads are:
  what tools that write objects (the converters) write through."""
  return objects()._store(url, settings or StorageSettings())  # pylint: disable=protected-access


def reason(e: BaseException) -> str:
  """A storage error as a message may show it: never a body or a signed query."""
  return _reason(e)


def objects() -> Objects:
  """This process's Objects."""
  global _objects
  with _objects_lock:
    if _objects is None:
      _objects = Objects()
    return _objects
