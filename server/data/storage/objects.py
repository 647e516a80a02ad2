"""Objects through obstore: globs listed, identities read, byte ranges
fetched concurrently and pinned to the object's recorded version.

Every read of a served object is conditional: `If-Match` on its recorded
ETag, or on GCS its recorded generation (`generation=`), so a replaced
object answers 412 or 404, never other bytes. obstore retries transient
errors (5xx, 429, connection resets, timeouts) with backoff and jitter for
the dataset's retry budget (settings.py); past it a read fails
ServiceUnavailableError (UNAVAILABLE) naming the object, which a client
retries. Messages name the URL and the HTTP status, never a response body
or a credential.

Fetches run on one event loop per process (a daemon thread), at most
MAX_IN_FLIGHT at once: a batch's ranges over all its shards go out together,
and the read-ahead's (read_ahead.py) beside them. Each request's time is
reported to `counts` (the server's metrics; nothing by default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import re
import threading
import time
from typing import Any, Sequence

from grain_elevator.proto.errors import (ConfigError, DataLossError, ServiceUnavailableError,
                                         ShardChangedError)
from grain_elevator.server.data.storage import settings as settings_lib
from grain_elevator.server.data.storage import urls
from grain_elevator.server.data.storage.settings import StorageSettings

# Range reads in flight at once in one process (a worker): a bucket answers
# in ~20-50 ms whatever the size up to a few MB, so hundreds in flight keep
# a worker's reads going at its bandwidth rather than at one batch per round trip.
MAX_IN_FLIGHT = 128
# Of those, reads made ahead of need (read_ahead.py) hold at most this many:
# the rest are kept for the reads of the step being made now.
AHEAD_IN_FLIGHT = MAX_IN_FLIGHT * 3 // 4
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


class Counts:
  """What storage reads report (the server's metrics implement it): the
  seconds of each ranged request. Here: nothing."""

  def storage_request(self, seconds: float) -> None:
    pass


_counts: Counts = Counts()


def set_counts(counts: Counts) -> None:
  """Where this process's reads report (a worker: its metrics)."""
  global _counts
  _counts = counts


class _Failure(Exception):
  """An obstore error, classified: `kind` is one of "missing", "denied",
  "changed", "unavailable", "other"; `reason` is safe to show."""

  def __init__(self, kind: str, reason: str):
    super().__init__(reason)
    self.kind = kind
    self.reason = reason


_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z][A-Za-z -]*))?")


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
  if status is not None and status < 500 and status != 429:
    return _Failure("other", reason)
  return _Failure("unavailable", reason)


class Objects:
  """This process's stores and fetch loop. Thread-safe: the stores are
  guarded by their own lock, the loop is started once under `_lock`."""

  def __init__(self):
    self._stores = settings_lib.Stores()
    self._lock = threading.Lock()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._loop_pid = -1
    self._semaphore: asyncio.Semaphore | None = None
    self._ahead: asyncio.Semaphore | None = None

  def _store(self, url: str, settings: StorageSettings) -> tuple[Any, str]:
    scheme, bucket, key = urls.split(url)
    try:
      return self._stores.get(scheme, bucket, settings), key
    except ImportError as e:
      raise ConfigError(f"{url}: reading objects needs obstore (pip install obstore): {e}") from e
    except Exception as e:  # a bad endpoint or region
      raise ConfigError(f"{url}: cannot set up the {scheme}:// client: {_reason(e)}") from e

  def _event_loop(self) -> asyncio.AbstractEventLoop:
    with self._lock:
      if self._loop is None or self._loop_pid != os.getpid():
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="elevator-storage").start()
        self._loop, self._loop_pid = loop, os.getpid()
        self._semaphore = self._ahead = None
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

  def fetch(self, ranges: Sequence[tuple[ObjectRef, int, int]]) -> list[bytes]:
    """The bytes [begin, end) of each object, fetched concurrently, each
    read pinned to the object's recorded version. Raises ShardChangedError
    (replaced or deleted), ServiceUnavailableError (past the retry budget,
    or access lost) or DataLossError (a short read), naming the object."""
    if not ranges:
      return []
    return self._run(self._fetch_all(ranges))

  def fetch_later(self, ranges: Sequence[tuple[ObjectRef, int, int]]
                  ) -> list[concurrent.futures.Future]:
    """`fetch` without waiting: a future of each range's bytes (or of the
    error `fetch` would raise), all requested concurrently from now."""
    loop = self._event_loop()
    return [asyncio.run_coroutine_threadsafe(self._fetch_ahead(*r), loop) for r in ranges]

  async def _fetch_ahead(self, obj: ObjectRef, begin: int, end: int) -> bytes:
    """A read made ahead of need: at most AHEAD_IN_FLIGHT of them hold a
    slot, so a step's own reads always find one free."""
    if self._ahead is None:  # made in the loop's thread, which alone uses it
      self._ahead = asyncio.Semaphore(AHEAD_IN_FLIGHT)
    async with self._ahead:
      return await self._fetch_one(obj, begin, end)

  async def _fetch_all(self, ranges: Sequence[tuple[ObjectRef, int, int]]) -> list[bytes]:
    tasks = [asyncio.ensure_future(self._fetch_one(*r)) for r in ranges]
    try:
      return list(await asyncio.gather(*tasks))
    finally:
      for t in tasks:
        t.cancel()

  async def _fetch_one(self, obj: ObjectRef, begin: int, end: int) -> bytes:
    import obstore  # pylint: disable=g-import-not-at-top
    store, key = self._store(obj.url, obj.settings)
    options: dict[str, Any] = {"range": (begin, end)}
    if obj.version is not None and obj.url.startswith("gs://"):
      options["version"] = obj.version  # GCS: the generation, pinned
    elif obj.etag is not None:
      options["if_match"] = obj.etag
    elif obj.version is not None:
      options["version"] = obj.version
    if self._semaphore is None:  # made in the loop's thread, which alone uses it
      self._semaphore = asyncio.Semaphore(MAX_IN_FLIGHT)
    async with self._semaphore:
      began = time.perf_counter()
      try:
        result = await obstore.get_async(store, key, options=options)
        data = await result.bytes_async()
      except Exception as e:  # pylint: disable=broad-except
        raise serving_error(obj, begin, _classify(e)) from e
      finally:
        _counts.storage_request(time.perf_counter() - began)
    if len(data) != end - begin:
      raise DataLossError(f"object {obj.url}: a read of bytes [{begin}, {end}) returned "
                          f"{len(data)} bytes")
    return bytes(data)


def serving_error(obj: ObjectRef, begin: int, failure: _Failure) -> Exception:
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
