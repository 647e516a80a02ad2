"""How a dataset reaches its bucket: the cloud's standard environment, and
an optional `[datasets.NAME.storage]` table for anything else.

```toml
[datasets.NAME.storage]        # all optional; the values are examples
endpoint = "http://minio:9000"  # S3: else AWS_ENDPOINT_URL; GCS: else STORAGE_EMULATOR_HOST
region = "eu-west-1"            # S3: else AWS_REGION / AWS_DEFAULT_REGION
anonymous = true                # unsigned requests (public buckets)
retry_s = 60                    # how long a read may retry; else DEFAULT_RETRY_S (below)
request_timeout_s = 10          # one request's limit, a stall past it retried;
                                # else REQUEST_TIMEOUT_S (below)
```

Credentials never come from this file: S3 reads AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, web identity tokens on EKS,
instance metadata), GCS application default credentials
(GOOGLE_APPLICATION_CREDENTIALS, workload identity on GKE), Azure its
AZURE_STORAGE_* variables, each through obstore's own lookup. An endpoint
that says http:// is allowed plain HTTP; STORAGE_EMULATOR_HOST means
unsigned requests, as Google's client libraries take it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
from typing import Any

from grain_elevator.proto.errors import ConfigError

# How long one read may keep retrying transient errors (5xx, 429, resets,
# stalls) with backoff and jitter before the step fails UNAVAILABLE naming
# the object; the client then retries the step. A storage outage shorter
# than this costs time, never data.
DEFAULT_RETRY_S = 30.0
MAX_RETRY_S = 600.0
# One HTTP request's limit, connection included: a stalled read is cut here
# and retried (within the retry budget).
REQUEST_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 5.0
# Backoff between retries: exponential from the first to the last, with
# object_store's jitter.
_BACKOFF = {"init_backoff": datetime.timedelta(milliseconds=100),
            "max_backoff": datetime.timedelta(seconds=2), "base": 2}
_KEYS = {"endpoint": str, "region": str, "anonymous": bool, "retry_s": (int, float),
         "request_timeout_s": (int, float)}


@dataclasses.dataclass(frozen=True)
class StorageSettings:
  """A dataset's `[datasets.NAME.storage]` table, checked (all optional)."""

  endpoint: str | None = None
  region: str | None = None
  anonymous: bool = False
  retry_s: float = DEFAULT_RETRY_S
  request_timeout_s: float = REQUEST_TIMEOUT_S


def parse(dataset: str, table: Any) -> StorageSettings:
  """The table, checked; ConfigError names the dataset and the key."""
  if not isinstance(table, dict):
    raise ConfigError(f"dataset {dataset!r}: [datasets.{dataset}.storage] must be a table")
  unknown = sorted(set(table) - set(_KEYS))
  if unknown:
    raise ConfigError(f"dataset {dataset!r}: unknown storage key(s) "
                      f"{', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(_KEYS))} "
                      "(credentials come from the environment, never from this file)")
  for key, value in table.items():
    if not isinstance(value, _KEYS[key]) or (key != "anonymous" and isinstance(value, bool)):
      raise ConfigError(f"dataset {dataset!r}: storage key {key!r} has the wrong type: "
                        f"{type(value).__name__}")
  timeout_s = table.get("request_timeout_s")
  try:
    retry_s, timeout_s = budget(float(table.get("retry_s", DEFAULT_RETRY_S)),
                                None if timeout_s is None else float(timeout_s))
  except ValueError as e:
    raise ConfigError(f"dataset {dataset!r}: storage key {e}") from None
  return StorageSettings(endpoint=table.get("endpoint"), region=table.get("region"),
                         anonymous=table.get("anonymous", False), retry_s=retry_s,
                         request_timeout_s=timeout_s)


def budget(retry_s: float, timeout_s: float | None = None) -> tuple[float, float]:
  """(retry_s, request_timeout_s), checked; a request's timeout defaults to
  REQUEST_TIMEOUT_S within the retry budget. ValueError names the bound."""
  if not 0 < retry_s <= MAX_RETRY_S:
    raise ValueError(f"'retry_s' must be in (0, {MAX_RETRY_S:g}], got {retry_s}")
  timeout_s = min(REQUEST_TIMEOUT_S, retry_s) if timeout_s is None else timeout_s
  if not 0 < timeout_s <= retry_s:
    raise ValueError(f"'request_timeout_s' must be in (0, retry_s = {retry_s:g}], "
                     f"got {timeout_s:g}")
  return retry_s, timeout_s


def _client_options(endpoint: str | None, settings: StorageSettings) -> dict[str, Any]:
  return {"timeout": datetime.timedelta(seconds=settings.request_timeout_s),
          "connect_timeout": datetime.timedelta(
              seconds=min(CONNECT_TIMEOUT_S, settings.request_timeout_s)),
          "allow_http": bool(endpoint and endpoint.startswith("http://"))}


def _retry(settings: StorageSettings, retries: bool) -> dict[str, Any]:
  return {"max_retries": 1000 if retries else 0, "backoff": _BACKOFF,
          "retry_timeout": datetime.timedelta(seconds=settings.retry_s)}


def build_store(scheme: str, bucket: str, settings: StorageSettings, retries: bool = True) -> Any:
  """An obstore store for one bucket (raises what obstore raises).
  `retries=False`: one that gives up at the first error, for the serving
  reads, which retry themselves (objects.py: to see each 503 and 429, and
  to ask a straggler again)."""
  from obstore import store as obstore_store  # pylint: disable=g-import-not-at-top
  retry = _retry(settings, retries)
  if scheme == "s3":
    endpoint = settings.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL")
    config: dict[str, Any] = {}
    if endpoint:
      config["endpoint"] = endpoint
    region = settings.region or os.environ.get("AWS_REGION") or os.environ.get(
        "AWS_DEFAULT_REGION")
    if region:
      config["region"] = region
    if settings.anonymous:
      config["skip_signature"] = True
    return obstore_store.S3Store(bucket, config=config, retry_config=retry,
                                 client_options=_client_options(endpoint, settings))
  if scheme == "gs":
    endpoint = settings.endpoint
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not endpoint and emulator:
      endpoint = emulator if "://" in emulator else f"http://{emulator}"
    config = {"base_url": endpoint} if endpoint else {}
    if settings.anonymous or (emulator and not settings.endpoint):
      config["skip_signature"] = True
    return obstore_store.GCSStore(bucket, config=config, retry_config=retry,
                                  client_options=_client_options(endpoint, settings))
  if scheme == "az":
    config = {"endpoint": settings.endpoint} if settings.endpoint else {}
    if settings.anonymous:
      config["skip_signature"] = True
    return obstore_store.AzureStore(bucket, config=config,
                                    client_options=_client_options(settings.endpoint, settings),
                                    retry_config=retry)
  raise ValueError(f"unknown scheme {scheme!r}")


# The environment a store is built from: a store is made again when it changes
# (embedded mode in a process whose environment a test or notebook changed).
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT",
        "GOOGLE_SERVICE_ACCOUNT_KEY", "AZURE_STORAGE_ACCOUNT_NAME")


class Stores:
  """One store per (scheme, bucket, settings, environment) in this process:
  each keeps its connection pool. Thread-safe (guarded by `_lock`)."""

  def __init__(self):
    self._stores: dict[tuple[Any, ...], Any] = {}
    self._lock = threading.Lock()

  def get(self, scheme: str, bucket: str, settings: StorageSettings,
          retries: bool = True) -> Any:
    key = (scheme, bucket, settings, retries, hash(tuple(os.environ.get(n) for n in _ENV)))
    with self._lock:
      store = self._stores.get(key)
      if store is None:
        store = self._stores[key] = build_store(scheme, bucket, settings, retries)
      return store


def secret_values() -> list[str]:
  """The credentials in the environment, which no message may hold."""
  names = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
           "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY", "AZURE_CLIENT_SECRET",
           "GOOGLE_SERVICE_ACCOUNT_KEY")
  return [v for v in (os.environ.get(n) for n in names) if v and len(v) >= 4]
