"""A fast stand-in object store on 127.0.0.1: a folder served as buckets to
obstore's S3Store and GCSStore, for the tests and the benchmarks.

Why: moto answers ~130 ranged GETs a second on this machine, so a bench that
read a bucket through it measured moto. This server answers thousands a
second on one core (tools/bench/store_rate.py measures it), and draws each
request's time to first byte from a distribution like a real bucket's, so
a bench sees a store's latency and not its emulator's CPU.

What it speaks (HTTP/1.1, keep-alive, one asyncio Protocol on uvloop where
installed): `ROOT/BUCKET/KEY` files as objects, for
- S3, path-style: `GET /BUCKET?list-type=2&prefix=&delimiter=&continuation-token=`
  (ListObjectsV2, 1000 a page), HEAD, GET (whole, or `Range: bytes=a-b`, `a-`,
  `-n`: 206 with Content-Range), PUT (atomically: a temporary file renamed;
  `x-amz-copy-source` copies), `POST /BUCKET?delete` (obstore's delete),
  multipart uploads (`?uploads`, `?partNumber=&uploadId=`, `?uploadId=`);
- GCS's XML API as obstore's GCSStore sends it to a `base_url`: the same
  calls, the key's slashes escaped (`/BUCKET/a%2Fb`), `generation=` on a
  GET or HEAD (another generation answers 404, as GCS), `x-goog-generation`
  on every answer, DELETE of one object (404 when missing), `x-goog-copy-source`.
ETags derive from (size, mtime_ns, inode), so a replaced object has a new one;
a GCS generation is the file's mtime_ns (a PUT makes it grow). `If-Match`,
`If-None-Match`, `x-goog-if-generation-match` are honoured (412, or 304).
Missing objects and buckets answer 404 with S3's XML error body.

Knobs (command-line flags, `StandInStore(**options)`, or at run time through
`POST /_standin/config`): the time to first byte (log-normal by its p50 and
p99, or none), `max_rate` requests/s per prefix (bucket + the key's folder;
past it 503 SlowDown in S3 mode, 429 in GCS mode, as the real stores do), a
`bytes_per_s` cap per connection, `max_object_bytes` (413 past it), and
`lie`: how a ranged GET is answered wrongly, for the tests of a store that
lies (LIES: "oversized", a 206 with the right Content-Range whose
Content-Length and body run on to `lie_bytes`; "whole", a 200 with the
whole object; "shifted", a 206 of the range one byte on, which its
Content-Range says; "no_length", the right 206 without a Content-Length,
its end the connection's close). Headers over 16 KiB answer 431.
`GET /_standin/stats` reports requests, ranged GETs, body bytes, refusals,
statuses, this process's CPU seconds, and requests in flight: now, at peak,
and their time-weighted mean since the last reset (how a bench sees its
reader's depth). No S3 or GCS client sends `/_standin/`
(no bucket name starts with `_`).

Signatures and credentials are not checked. Files whose name starts with
`.standin-` are its own (temporary files, multipart parts) and never listed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import email.utils
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import stat as stat_lib
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
from typing import Any, Callable
from xml.sax.saxutils import escape

from grain_elevator.server.process import lifeline
from grain_elevator.tools.testing import storage_servers

KINDS = ("s3", "gcs")
MAX_HEADER_BYTES = 16 * 1024
PAGE = 1000  # ListObjectsV2's most keys a page
DEFAULT_TTFB_P50_MS = 25.0
DEFAULT_TTFB_P99_MS = 150.0
DEFAULT_MAX_OBJECT_BYTES = 5 << 30
# The standard normal's 99th percentile: sigma = ln(p99 / p50) / Z99.
Z99 = 2.3263
CONTROL = "/_standin/"
HIDDEN = ".standin-"  # this server's own files
# A range up to this many bytes is read at once; a longer body is read and
# written in pieces of this size, as the connection drains.
PIECE = 256 * 1024
# Open files kept (a bench reads a few shards over and over).
OPEN_FILES = 256
# Request bodies held in memory at most (bulk deletes, multipart completion);
# an object's bytes go to a file as they come.
MAX_SMALL_BODY = 4 << 20
START_TIMEOUT_S = 60.0
# How a ranged GET may be answered wrongly (Options.lie; "" answers right).
LIES = ("", "oversized", "whole", "shifted", "no_length")
# An "oversized" answer's Content-Length by default.
DEFAULT_LIE_BYTES = 1 << 30

_REASONS = {200: "OK", 204: "No Content", 206: "Partial Content", 304: "Not Modified",
            400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 411: "Length Required", 412: "Precondition Failed",
            413: "Payload Too Large", 416: "Range Not Satisfiable",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}
_STATUS_LINES = {s: f"HTTP/1.1 {s} {r}\r\n" for s, r in _REASONS.items()}
_S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_XML_HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n'


@dataclasses.dataclass
class Options:
  """What a store's answers look like; all of it can change at run time."""

  ttfb_p50_ms: float = DEFAULT_TTFB_P50_MS  # 0: no delay
  ttfb_p99_ms: float = DEFAULT_TTFB_P99_MS
  max_rate: float = 0.0  # requests/s per prefix; 0: unlimited
  bytes_per_s: float = 0.0  # per connection; 0: unlimited
  seed: int = 0
  max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
  lie: str = ""  # one of LIES: how ranged GETs are answered wrongly
  lie_bytes: int = DEFAULT_LIE_BYTES  # an "oversized" answer's Content-Length

  def update(self, changes: dict[str, Any]) -> None:
    """Applies `changes` (`ttfb=0` turns the delay off); ValueError on a bad one."""
    changes = dict(changes)
    if "ttfb" in changes:
      if float(changes.pop("ttfb")) != 0:
        raise ValueError("ttfb may only be 0 (none); else set ttfb_p50_ms and ttfb_p99_ms")
      changes["ttfb_p50_ms"] = changes["ttfb_p99_ms"] = 0.0
    fields = {f.name for f in dataclasses.fields(self)}
    for name, value in changes.items():
      if name not in fields:
        raise ValueError(f"unknown option {name!r}; one of {sorted(fields)} or ttfb")
      if name == "lie":
        if value not in LIES:
          raise ValueError(f"lie must be one of {LIES}, got {value!r}")
        self.lie = value
        continue
      setattr(self, name, int(value) if name in ("seed", "max_object_bytes", "lie_bytes")
              else float(value))
    if self.ttfb_p50_ms < 0 or (self.ttfb_p50_ms > 0 and self.ttfb_p99_ms < self.ttfb_p50_ms):
      raise ValueError(f"need 0 <= ttfb_p50_ms <= ttfb_p99_ms, got {self.ttfb_p50_ms} and "
                       f"{self.ttfb_p99_ms}")
    if (self.max_rate < 0 or self.bytes_per_s < 0 or self.max_object_bytes < 0
        or self.lie_bytes < 0):
      raise ValueError("max_rate, bytes_per_s, max_object_bytes and lie_bytes must be >= 0")


class Ttfb:
  """Times to first byte, log-normal with the given median and 99th
  percentile (seconds), drawn in order from `seed`: the same seed gives the
  same sequence, so a run is repeatable. A median of 0 draws 0."""

  def __init__(self, p50_s: float, p99_s: float, seed: int = 0):
    self._rng = random.Random(seed)
    self.set(p50_s, p99_s)

  def set(self, p50_s: float, p99_s: float) -> None:
    self.p50_s, self.p99_s = p50_s, p99_s
    self._mu = math.log(p50_s) if p50_s > 0 else 0.0
    self._sigma = math.log(p99_s / p50_s) / Z99 if p50_s > 0 else 0.0

  def __call__(self) -> float:
    if self.p50_s <= 0:
      return 0.0
    return math.exp(self._mu + self._sigma * self._rng.gauss(0.0, 1.0))


class Stats:
  """Counters since the last reset, and requests in flight: now, the peak,
  and the integral over time whose mean is the reader's depth."""

  def __init__(self, clock: Callable[[], float]):
    self._clock = clock
    self.in_flight = 0
    self.reset()

  def reset(self) -> None:
    self.requests = self.ranged_gets = self.body_bytes = self.refused = 0
    self.ttfb_draws = 0
    self.ttfb_sum_s = 0.0
    self.statuses: dict[int, int] = {}
    self.in_flight_peak = self.in_flight
    self._since = self._last = self._clock()
    self._integral = 0.0
    self._cpu0 = time.process_time()

  def begin(self) -> None:
    now = self._clock()
    self._integral += self.in_flight * (now - self._last)
    self._last = now
    self.in_flight += 1
    if self.in_flight > self.in_flight_peak:
      self.in_flight_peak = self.in_flight

  def end(self) -> None:
    now = self._clock()
    self._integral += self.in_flight * (now - self._last)
    self._last = now
    self.in_flight -= 1

  def as_dict(self) -> dict[str, Any]:
    now = self._clock()
    window = now - self._since
    integral = self._integral + self.in_flight * (now - self._last)
    return {"requests": self.requests, "ranged_gets": self.ranged_gets,
            "body_bytes": self.body_bytes, "refused": self.refused,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "in_flight": self.in_flight, "in_flight_peak": self.in_flight_peak,
            "in_flight_mean": integral / window if window > 0 else float(self.in_flight),
            "window_s": window, "ttfb_draws": self.ttfb_draws, "ttfb_sum_s": self.ttfb_sum_s,
            "cpu_s": time.process_time(), "window_cpu_s": time.process_time() - self._cpu0,
            "pid": os.getpid()}


class _Throttle:
  """A token bucket per prefix: `rate` a second, a burst of one second's."""

  def __init__(self):
    self.rate = 0.0
    self._buckets: dict[str, list[float]] = {}

  def allow(self, prefix: str, now: float) -> bool:
    b = self._buckets.get(prefix)
    if b is None:
      if len(self._buckets) > 100_000:
        self._buckets.clear()
      self._buckets[prefix] = [self.rate - 1.0, now]
      return True
    tokens = min(self.rate, b[0] + (now - b[1]) * self.rate)
    b[1] = now
    if tokens >= 1.0:
      b[0] = tokens - 1.0
      return True
    b[0] = tokens
    return False

  def clear(self) -> None:
    self._buckets.clear()


class _Files:
  """Open files by path, reopened when the path names another inode (the
  object was replaced); the oldest closed past OPEN_FILES."""

  def __init__(self):
    self._open: dict[str, tuple[int, int]] = {}

  def get(self, path: str) -> tuple[int, os.stat_result]:
    """(fd, its stat) of the file at `path`; OSError when there is none.
    The fd stays this cache's: dup it to keep it past this call."""
    st = os.stat(path)
    hit = self._open.get(path)
    if hit is not None and hit[1] == st.st_ino:
      return hit[0], st
    if not stat_lib.S_ISREG(st.st_mode):
      raise IsADirectoryError(path)
    if hit is not None:
      del self._open[path]
      os.close(hit[0])
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if len(self._open) >= OPEN_FILES:
      old = next(iter(self._open))
      os.close(self._open.pop(old)[0])
    self._open[path] = (fd, st.st_ino)
    return fd, st

  def forget(self, path: str) -> None:
    hit = self._open.pop(path, None)
    if hit is not None:
      os.close(hit[0])


class _FileBody:
  """`length` bytes of an open file from `offset`, read a piece at a time;
  the fd is this body's."""

  __slots__ = ("fd", "offset", "length")

  def __init__(self, fd: int, offset: int, length: int):
    self.fd, self.offset, self.length = fd, offset, length

  def read(self, n: int) -> bytes:
    data = os.pread(self.fd, n, self.offset)
    self.offset += len(data)
    self.length -= len(data)
    return data

  def close(self) -> None:
    os.close(self.fd)


class _BytesBody:
  """Bytes sent a piece at a time (a paced body)."""

  def __init__(self, data: bytes):
    self._data = memoryview(data)
    self.length = len(data)
    self._at = 0

  def read(self, n: int) -> bytes:
    out = self._data[self._at:self._at + n]
    self._at += n
    self.length -= n
    return bytes(out)

  def close(self) -> None:
    pass


class _PaddedBody:
  """`data`, then zeros up to `length` in all: an answer longer than it says
  its range is (a lie), sent as the connection drains."""

  def __init__(self, data: bytes, length: int):
    self._data = data
    self.length = length

  def read(self, n: int) -> bytes:
    head, self._data = self._data[:n], self._data[n:]
    out = head + bytes(min(n, self.length) - len(head))
    self.length -= len(out)
    return out

  def close(self) -> None:
    pass


class _Request:
  __slots__ = ("method", "target", "headers", "path", "query", "bucket", "key", "sink",
               "body", "early", "control", "close")

  def __init__(self, method: str, target: str, headers: dict[str, str]):
    self.method = method
    self.target = target
    self.headers = headers
    self.sink: Any = None  # where the body goes: _FileSink, bytearray or None (dropped)
    self.body: Any = None
    self.early: Any = None  # the answer decided from the headers alone
    self.control = False
    self.close = False


class _FileSink:
  """A request body written to a temporary file next to where it will be renamed."""

  def __init__(self, folder: str):
    self.path = os.path.join(folder, f"{HIDDEN}{secrets.token_hex(8)}")
    self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    self.size = 0

  def write(self, data: bytes) -> None:
    view = memoryview(data)
    while view:
      n = os.write(self.fd, view)
      view = view[n:]
    self.size += len(data)

  def close(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1

  def discard(self) -> None:
    self.close()
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass


# An answer: (status, header lines, body: bytes or a body read in pieces
# (_FileBody, _PaddedBody), Content-Length if it differs from the body's (a
# HEAD); NO_LENGTH: none sent, the body ends with the connection).
Answer = tuple[int, str, Any, int]
NO_LENGTH = -2


_DATES: dict[int, str] = {}


def _http_date(t: float) -> str:
  s = int(t)
  out = _DATES.get(s)
  if out is None:
    if len(_DATES) > 4096:
      _DATES.clear()
    out = _DATES[s] = email.utils.formatdate(s, usegmt=True)
  return out


def _unmet(condition: str) -> Answer:
  return _error(412, "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold",
                f"<Condition>{condition}</Condition>")


def _error(status: int, code: str, message: str, extra: str = "") -> Answer:
  """An answer with S3's XML error body (GCS's XML API sends the same shape)."""
  body = (f"{_XML_HEAD}<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
          f"{extra}</Error>").encode()
  return status, "Content-Type: application/xml\r\n", body, -1


def _iso_date(mtime_ns: int) -> str:
  s, ns = divmod(mtime_ns, 1_000_000_000)
  return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{ns // 1_000_000:03d}Z"


def etag_of(st: os.stat_result) -> str:
  """An object's ETag: a replaced object (new inode) or a rewritten one (new
  size or mtime) has a new one."""
  return f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'


def _bad_key(key: str) -> bool:
  """Whether `key` cannot be a file under its bucket's folder."""
  return (not key or key[0] == "/" or "\0" in key
          or any(p in ("", ".", "..") or p.startswith(HIDDEN) for p in key.split("/")))


def _bump_mtime(path: str, after_ns: int) -> None:
  """Makes the file's mtime (a GCS generation) later than `after_ns`: the
  clock that stamps files may not have moved since the object it replaces."""
  now = time.time_ns()
  if now <= after_ns:
    now = after_ns + 1
  os.utime(path, ns=(now, now))


class _Store:
  """Everything the connections share: the folder, the options, the stats.
  Runs on one event loop's thread."""

  def __init__(self, root: str, kind: str, options: Options, loop: asyncio.AbstractEventLoop):
    if kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    self.root = os.path.abspath(root)
    self.kind = kind
    self.gcs = kind == "gcs"
    self.loop = loop
    self.options = options
    self.stats = Stats(loop.time)
    self.files = _Files()
    self.throttle = _Throttle()
    self.ttfb = Ttfb(0.0, 0.0, options.seed)
    self._listings: dict[str, list[tuple[str, Any]]] = {}
    self.configure({})

  def configure(self, changes: dict[str, Any]) -> None:
    self.options.update(changes)
    o = self.options
    if "seed" in changes:
      self.ttfb = Ttfb(0.0, 0.0, o.seed)
    self.ttfb.set(o.ttfb_p50_ms / 1000, o.ttfb_p99_ms / 1000)
    if self.throttle.rate != o.max_rate:
      self.throttle.clear()
    self.throttle.rate = o.max_rate

  # -- the request line and headers are in ---------------------------------

  def begin(self, req: _Request) -> None:
    """Parses the target and decides what can be decided before the body:
    where it goes, or an early answer (throttled, too large, refused)."""
    path, _, query = req.target.partition("?")
    if path.startswith(CONTROL):
      req.control = True
      req.path = path
      req.query = query
      if int(req.headers.get("content-length", 0) or 0) > MAX_SMALL_BODY:
        req.early = _error(413, "EntityTooLarge", "the request's body is too large")
        req.close = True
      else:
        req.sink = bytearray()
      return
    stats = self.stats
    stats.requests += 1
    headers = req.headers
    if "%" in path:
      bucket, _, key = path[1:].partition("/")
      key = urllib.parse.unquote(key)
    else:
      bucket, _, key = path[1:].partition("/")
    req.bucket, req.key = bucket, key
    req.query = urllib.parse.parse_qs(query, keep_blank_values=True) if query else None
    method = req.method
    if method == "GET" and "range" in headers:
      stats.ranged_gets += 1
    if self.throttle.rate > 0:
      if key:
        folder = key.rpartition("/")[0]
      else:
        folder = (req.query or {}).get("prefix", [""])[0].rpartition("/")[0]
      if not self.throttle.allow(f"{bucket}/{folder}", self.loop.time()):
        stats.refused += 1
        # S3's status and code; GCS's status (obstore reads only the status).
        req.early = _error(429 if self.gcs else 503, "SlowDown",
                           "Please reduce your request rate.")
        return
    length = int(headers.get("content-length", 0) or 0)
    if not length:
      return
    if method == "PUT" and key and not _bad_key(key) and "x-amz-copy-source" not in headers \
        and "x-goog-copy-source" not in headers:
      if length > self.options.max_object_bytes:
        req.early = _error(413, "EntityTooLarge",
                           "Your proposed upload exceeds the maximum allowed size")
        req.close = True
        return
      folder = self._upload_folder(req) if req.query and "uploadId" in req.query else \
          os.path.dirname(os.path.join(self.root, bucket, key))
      if folder is None:
        req.early = _error(404, "NoSuchUpload", "The specified upload does not exist.")
        return
      if not os.path.isdir(os.path.join(self.root, bucket)):
        req.early = self._no_bucket(bucket)
        return
      try:
        os.makedirs(folder, exist_ok=True)
        req.sink = _FileSink(folder)
      except OSError as e:
        req.early = _error(409 if isinstance(e, (FileExistsError, NotADirectoryError))
                           else 500, "InvalidRequest", f"cannot write {key}: {e}")
      return
    if length > MAX_SMALL_BODY:
      req.early = _error(413, "EntityTooLarge", "the request's body is too large")
      req.close = True
      return
    req.sink = bytearray()

  def _upload_folder(self, req: _Request) -> str | None:
    upload = req.query["uploadId"][0]
    folder = os.path.join(self.root, HIDDEN + "uploads", upload)
    return folder if upload.isalnum() and os.path.isdir(folder) else None

  # -- the whole request is in -----------------------------------------------

  def answer(self, req: _Request) -> Answer:
    """The answer to a storage request (a control request: `control`)."""
    if req.early is not None:
      if isinstance(req.sink, _FileSink):
        req.sink.discard()
      return req.early
    try:
      return self._route(req)
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(req.sink, _FileSink):
        req.sink.discard()
      print(f"object_store: {req.method} {req.target}: {type(e).__name__}: {e}",
            file=sys.stderr, flush=True)
      return _error(500, "InternalError", f"{type(e).__name__}: {e}")

  def _route(self, req: _Request) -> Answer:
    method, bucket, key, query = req.method, req.bucket, req.key, req.query
    if not bucket or bucket.startswith((".", "_")):
      return _error(400, "InvalidBucketName", "The specified bucket is not valid.")
    if not key:
      if method == "GET":
        return self._list(bucket, query or {})
      if method == "HEAD":
        return self._bucket_head(bucket)
      if method == "PUT":
        os.makedirs(os.path.join(self.root, bucket), exist_ok=True)
        return 200, "", b"", -1
      if method == "POST" and query is not None and "delete" in query:
        return self._bulk_delete(bucket, bytes(req.sink or b""))
      return _error(405, "MethodNotAllowed", f"{method} of a bucket")
    if _bad_key(key):
      if method in ("GET", "HEAD", "DELETE"):
        return self._missing(bucket, key)
      return _error(400, "InvalidArgument", f"key {key!r} cannot be stored here")
    if method == "GET" or method == "HEAD":
      return self._get(req)
    if query is not None:
      if method == "POST" and "uploads" in query:
        return self._initiate(bucket, key)
      if "uploadId" in query:
        return self._multipart(req)
    if method == "PUT":
      if "x-amz-copy-source" in req.headers or "x-goog-copy-source" in req.headers:
        return self._copy(req)
      return self._put(req)
    if method == "DELETE":
      return self._delete(bucket, key)
    return _error(405, "MethodNotAllowed", f"{method} of an object")

  # -- answers -------------------------------------------------------------------

  def _no_bucket(self, bucket: str) -> Answer:
    return _error(404, "NoSuchBucket", "The specified bucket does not exist.",
                  f"<BucketName>{escape(bucket)}</BucketName>")

  def _missing(self, bucket: str, key: str) -> Answer:
    if not os.path.isdir(os.path.join(self.root, bucket)):
      return self._no_bucket(bucket)
    details = f"<Details>No such object: {escape(bucket)}/{escape(key)}</Details>" if self.gcs \
        else f"<Key>{escape(key)}</Key>"
    return _error(404, "NoSuchKey", "The specified key does not exist.", details)

  def _meta_headers(self, st: os.stat_result, etag: str) -> str:
    out = (f"ETag: {etag}\r\nLast-Modified: {_http_date(st.st_mtime)}\r\n"
           "Content-Type: application/octet-stream\r\nAccept-Ranges: bytes\r\n")
    if self.gcs:
      out += f"x-goog-generation: {st.st_mtime_ns}\r\nx-goog-metageneration: 1\r\n"
    return out

  def _precondition(self, headers: dict[str, str], st: os.stat_result | None, etag: str | None,
                    reading: bool) -> Answer | None:
    """412 (or 304 for a read's If-None-Match) where a condition fails; None if all hold."""
    if_match = headers.get("if-match")
    if if_match is not None and (etag is None or (if_match != "*" and etag not in (
        t.strip() for t in if_match.split(",")))):
      return _unmet("If-Match")
    if_none = headers.get("if-none-match")
    if if_none is not None and etag is not None and (
        if_none == "*" or etag in (t.strip() for t in if_none.split(","))):
      if reading:
        return 304, f"ETag: {etag}\r\n", b"", -1
      return _unmet("If-None-Match")
    generation = headers.get("x-goog-if-generation-match")
    if generation is not None and generation != (str(st.st_mtime_ns) if st else "0"):
      return _unmet("x-goog-if-generation-match")
    if st is not None:
      for name, later_fails in (("if-unmodified-since", True), ("if-modified-since", False)):
        value = headers.get(name)
        if value is None:
          continue
        try:
          since = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
          continue
        modified_after = int(st.st_mtime) > since
        if later_fails and modified_after:
          return _unmet("If-Unmodified-Since")
        if not later_fails and not modified_after and reading:
          return 304, f"ETag: {etag}\r\n", b"", -1
    return None

  def _get(self, req: _Request) -> Answer:
    bucket, key, headers = req.bucket, req.key, req.headers
    path = f"{self.root}/{bucket}/{key}"
    try:
      fd, st = self.files.get(path)
    except OSError:
      return self._missing(bucket, key)
    query = req.query
    if query is not None:
      version = query.get("generation" if self.gcs else "versionId")
      if version is not None and version[0] != str(st.st_mtime_ns):
        if self.gcs:
          return self._missing(bucket, key)
        return _error(404, "NoSuchVersion", "The specified version does not exist.",
                      f"<Key>{escape(key)}</Key>")
    etag = etag_of(st)
    if ("if-match" in headers or "if-none-match" in headers or "if-modified-since" in headers
        or "if-unmodified-since" in headers or "x-goog-if-generation-match" in headers):
      refused = self._precondition(headers, st, etag, reading=True)
      if refused is not None:
        return refused
    size = st.st_size
    meta = self._meta_headers(st, etag)
    range_ = headers.get("range")
    if req.method == "HEAD":
      return 200, meta, b"", size
    if range_ is not None and range_.startswith("bytes=") and "," not in range_:
      first, _, last = range_[6:].partition("-")
      try:
        if first:
          begin = int(first)
          end = min(int(last) + 1, size) if last else size
        else:
          begin, end = max(size - int(last), 0), size
      except ValueError:
        begin, end = 0, -1  # malformed: the whole object, as HTTP says
      if end >= 0:
        if begin >= size or end <= begin:
          _, headers, body, _ = _error(416, "InvalidRange",
                                       "The requested range is not satisfiable")
          return 416, f"Content-Range: bytes */{size}\r\n{headers}", body, -1
        lie = self.options.lie
        if lie:
          return self._lie(lie, fd, meta, begin, end, size)
        meta += f"Content-Range: bytes {begin}-{end - 1}/{size}\r\n"
        return 206, meta, self._body(fd, begin, end - begin), -1
    return 200, meta, self._body(fd, 0, size), -1

  def _lie(self, lie: str, fd: int, meta: str, begin: int, end: int, size: int) -> Answer:
    """A wrong answer to a GET of bytes [begin, end) (Options.lie)."""
    if lie == "whole" or (lie == "shifted" and begin == 0 and end == size):
      return 200, meta, self._body(fd, 0, size), -1
    if lie == "shifted":
      shift = 1 if end < size else -1
      begin, end = begin + shift, end + shift
    meta += f"Content-Range: bytes {begin}-{end - 1}/{size}\r\n"
    if lie == "oversized":
      data = os.pread(fd, end - begin, begin)
      return 206, meta, _PaddedBody(data, max(self.options.lie_bytes, len(data))), -1
    body = self._body(fd, begin, end - begin)
    return 206, meta, body, NO_LENGTH if lie == "no_length" else -1

  def _body(self, fd: int, offset: int, length: int) -> Any:
    if length <= PIECE:
      data = os.pread(fd, length, offset)
      if len(data) != length:  # rewritten in place since the stat
        raise OSError(f"short read: {len(data)} of {length} bytes")
      return data
    return _FileBody(os.dup(fd), offset, length)

  def _bucket_head(self, bucket: str) -> Answer:
    if os.path.isdir(os.path.join(self.root, bucket)):
      return 200, "", b"", -1
    return self._no_bucket(bucket)

  def _current(self, path: str) -> os.stat_result | None:
    try:
      st = os.stat(path)
    except OSError:
      return None
    return st if stat_lib.S_ISREG(st.st_mode) else None

  def _stored(self, path: str, tmp: str, headers: dict[str, str]) -> Answer:
    """Renames the written `tmp` over `path` if the request's conditions
    hold on what is there now; the answer a PUT gets."""
    current = self._current(path)
    refused = self._precondition(headers, current, etag_of(current) if current else None,
                                 reading=False)
    if refused is not None:
      os.unlink(tmp)
      return refused
    _bump_mtime(tmp, current.st_mtime_ns if current else 0)
    os.replace(tmp, path)
    self.files.forget(path)
    st = os.stat(path)
    out = f"ETag: {etag_of(st)}\r\n"
    if self.gcs:
      out += f"x-goog-generation: {st.st_mtime_ns}\r\n"
    return 200, out, b"", -1

  def _put(self, req: _Request) -> Answer:
    bucket, key = req.bucket, req.key
    bucket_dir = os.path.join(self.root, bucket)
    if not os.path.isdir(bucket_dir):
      return self._no_bucket(bucket)
    path = os.path.join(bucket_dir, key)
    sink = req.sink
    if not isinstance(sink, _FileSink):  # an empty body
      try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        sink = _FileSink(os.path.dirname(path))
      except OSError as e:
        return _error(409, "InvalidRequest", f"cannot write {key}: {e}")
      sink.write(bytes(req.sink or b""))
    sink.close()
    if os.path.isdir(path):
      sink.discard()
      return _error(409, "InvalidRequest", f"{key} is a folder of other keys")
    return self._stored(path, sink.path, req.headers)

  def _copy(self, req: _Request) -> Answer:
    source = req.headers.get("x-amz-copy-source") or req.headers["x-goog-copy-source"]
    src_bucket, _, src_key = urllib.parse.unquote(source.lstrip("/")).partition("/")
    src_key = src_key.partition("?")[0]
    src = os.path.join(self.root, src_bucket, src_key)
    if _bad_key(src_key) or self._current(src) is None:
      return self._missing(src_bucket, src_key)
    path = os.path.join(self.root, req.bucket, req.key)
    if not os.path.isdir(os.path.join(self.root, req.bucket)):
      return self._no_bucket(req.bucket)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sink = _FileSink(os.path.dirname(path))
    sink.close()
    shutil.copyfile(src, sink.path)
    status, headers, _, _ = answer = self._stored(path, sink.path, req.headers)
    if status != 200:
      return answer
    st = os.stat(path)
    body = (f"{_XML_HEAD}<CopyObjectResult><LastModified>{_iso_date(st.st_mtime_ns)}"
            f"</LastModified><ETag>{escape(etag_of(st))}</ETag></CopyObjectResult>").encode()
    return 200, headers + "Content-Type: application/xml\r\n", body, -1

  def _delete(self, bucket: str, key: str) -> Answer:
    path = os.path.join(self.root, bucket, key)
    try:
      if self._current(path) is None:
        raise FileNotFoundError(path)
      os.unlink(path)
      self.files.forget(path)
    except FileNotFoundError:
      if self.gcs or not os.path.isdir(os.path.join(self.root, bucket)):
        return self._missing(bucket, key)  # GCS: 404; S3: 204 anyway
    return 204, "", b"", -1

  def _bulk_delete(self, bucket: str, body: bytes) -> Answer:
    """S3's DeleteObjects (obstore's delete): every key reported deleted,
    missing ones too, as S3 does."""
    if not os.path.isdir(os.path.join(self.root, bucket)):
      return self._no_bucket(bucket)
    try:
      doc = ElementTree.fromstring(body)
    except ElementTree.ParseError:
      return _error(400, "MalformedXML", "The XML you provided was not well-formed")
    quiet = any(e.tag.rpartition("}")[2] == "Quiet" and (e.text or "").strip() == "true"
                for e in doc)
    out = []
    for obj in doc:
      if obj.tag.rpartition("}")[2] != "Object":
        continue
      key = next((e.text or "" for e in obj if e.tag.rpartition("}")[2] == "Key"), "")
      path = os.path.join(self.root, bucket, key)
      if not _bad_key(key) and self._current(path) is not None:
        try:
          os.unlink(path)
          self.files.forget(path)
        except OSError as e:
          out.append(f"<Error><Key>{escape(key)}</Key><Code>InternalError</Code>"
                     f"<Message>{escape(str(e))}</Message></Error>")
          continue
      if not quiet:
        out.append(f"<Deleted><Key>{escape(key)}</Key></Deleted>")
    body = f'{_XML_HEAD}<DeleteResult xmlns="{_S3_NS}">{"".join(out)}</DeleteResult>'.encode()
    return 200, "Content-Type: application/xml\r\n", body, -1

  # -- multipart uploads -----------------------------------------------------------

  def _initiate(self, bucket: str, key: str) -> Answer:
    if not os.path.isdir(os.path.join(self.root, bucket)):
      return self._no_bucket(bucket)
    upload = secrets.token_hex(12)
    folder = os.path.join(self.root, HIDDEN + "uploads", upload)
    os.makedirs(folder)
    with open(os.path.join(folder, "target"), "w") as f:
      json.dump([bucket, key], f)
    body = (f'{_XML_HEAD}<InitiateMultipartUploadResult xmlns="{_S3_NS}"><Bucket>'
            f"{escape(bucket)}</Bucket><Key>{escape(key)}</Key><UploadId>{upload}</UploadId>"
            "</InitiateMultipartUploadResult>").encode()
    return 200, "Content-Type: application/xml\r\n", body, -1

  def _multipart(self, req: _Request) -> Answer:
    folder = self._upload_folder(req)
    if folder is None:
      return _error(404, "NoSuchUpload", "The specified upload does not exist.")
    method = req.method
    if method == "DELETE":
      shutil.rmtree(folder, ignore_errors=True)
      return 204, "", b"", -1
    if method == "PUT":
      part = req.query.get("partNumber", [""])[0]
      if not part.isdigit() or not 1 <= int(part) <= 10_000:
        return _error(400, "InvalidArgument", "partNumber must be 1 to 10000")
      sink = req.sink
      if not isinstance(sink, _FileSink):
        sink = _FileSink(folder)
        sink.write(bytes(req.sink or b""))
      sink.close()
      path = os.path.join(folder, f"part-{int(part)}")
      os.replace(sink.path, path)
      return 200, f"ETag: {etag_of(os.stat(path))}\r\n", b"", -1
    if method != "POST":
      return _error(405, "MethodNotAllowed", f"{method} of an upload")
    try:
      doc = ElementTree.fromstring(bytes(req.sink or b""))
    except ElementTree.ParseError:
      return _error(400, "MalformedXML", "The XML you provided was not well-formed")
    parts = []
    for p in doc:
      fields = {e.tag.rpartition("}")[2]: (e.text or "").strip() for e in p}
      path = os.path.join(folder, f"part-{fields.get('PartNumber', '')}")
      st = self._current(path)
      if st is None or fields.get("ETag", etag_of(st)) != etag_of(st):
        return _error(400, "InvalidPart", "One or more of the specified parts could not "
                      "be found or its ETag did not match")
      parts.append((path, st.st_size))
    if sum(size for _, size in parts) > self.options.max_object_bytes:
      return _error(413, "EntityTooLarge",
                    "Your proposed upload exceeds the maximum allowed size")
    with open(os.path.join(folder, "target")) as f:
      bucket, key = json.load(f)
    target = os.path.join(self.root, bucket, key)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    sink = _FileSink(os.path.dirname(target))
    try:
      for path, _ in parts:
        with open(path, "rb") as f:
          while True:
            data = f.read(1 << 20)
            if not data:
              break
            sink.write(data)
    except BaseException:
      sink.discard()
      raise
    sink.close()
    status, headers, _, _ = answer = self._stored(target, sink.path, req.headers)
    if status != 200:
      return answer
    shutil.rmtree(folder, ignore_errors=True)
    etag = headers.partition("ETag: ")[2].partition("\r\n")[0]
    body = (f'{_XML_HEAD}<CompleteMultipartUploadResult xmlns="{_S3_NS}"><Location>'
            f"/{escape(bucket)}/{escape(key)}</Location><Bucket>{escape(bucket)}</Bucket>"
            f"<Key>{escape(key)}</Key><ETag>{escape(etag)}</ETag>"
            "</CompleteMultipartUploadResult>").encode()
    return 200, headers + "Content-Type: application/xml\r\n", body, -1

  # -- listing ---------------------------------------------------------------------

  def _walk(self, bucket_dir: str, prefix: str) -> list[tuple[str, os.stat_result]]:
    """(key, stat) of every object under `prefix`, sorted by key (UTF-8 byte
    order, which is code-point order)."""
    start = prefix.rpartition("/")[0]
    out: list[tuple[str, os.stat_result]] = []
    todo = [start]
    while todo:
      folder = todo.pop()
      try:
        entries = list(os.scandir(os.path.join(bucket_dir, folder) if folder else bucket_dir))
      except (FileNotFoundError, NotADirectoryError):
        continue
      for e in entries:
        if e.name.startswith(HIDDEN):
          continue
        key = f"{folder}/{e.name}" if folder else e.name
        if e.is_dir(follow_symlinks=False):
          if key.startswith(prefix) or prefix.startswith(key + "/"):
            todo.append(key)
        elif key.startswith(prefix):
          try:
            out.append((key, e.stat()))
          except FileNotFoundError:
            pass
    out.sort(key=lambda kv: kv[0])
    return out

  def _list(self, bucket: str, query: dict[str, list[str]]) -> Answer:
    bucket_dir = os.path.join(self.root, bucket)
    if not os.path.isdir(bucket_dir):
      return self._no_bucket(bucket)
    prefix = query.get("prefix", [""])[0]
    delimiter = query.get("delimiter", [""])[0]
    try:
      max_keys = max(0, min(int(query.get("max-keys", [PAGE])[0]), PAGE))
    except ValueError:
      return _error(400, "InvalidArgument", "max-keys must be an integer")
    token = query.get("continuation-token", [None])[0]
    after = query.get("start-after", [""])[0]
    snapshot, items = None, None
    if token is not None:
      try:
        snapshot, _, after = base64.urlsafe_b64decode(token.encode()).decode().partition(":")
      except ValueError:
        return _error(400, "InvalidArgument", "The continuation token provided is incorrect")
      items = self._listings.get(snapshot)
    if items is None:
      items = []
      for key, st in self._walk(bucket_dir, prefix):
        if delimiter:
          cut = key.find(delimiter, len(prefix))
          if cut >= 0:
            common = key[:cut + len(delimiter)]
            if not items or items[-1][0] != common:
              items.append((common, None))
            continue
        items.append((key, st))
    first = 0
    if after:
      lo, hi = 0, len(items)
      while lo < hi:  # the first item past `after`
        mid = (lo + hi) // 2
        if items[mid][0] <= after:
          lo = mid + 1
        else:
          hi = mid
      first = lo
    page = items[first:first + max_keys]
    truncated = first + max_keys < len(items)
    parts = [f'{_XML_HEAD}<ListBucketResult xmlns="{_S3_NS}"><Name>{escape(bucket)}</Name>'
             f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
             f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>"]
    if delimiter:
      parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
    if token is not None:
      parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
    if truncated:
      if snapshot is None or snapshot not in self._listings:
        snapshot = secrets.token_hex(6)
        if len(self._listings) >= 8:
          del self._listings[next(iter(self._listings))]
        self._listings[snapshot] = items
      next_token = base64.urlsafe_b64encode(f"{snapshot}:{page[-1][0]}".encode()).decode()
      parts.append(f"<NextContinuationToken>{next_token}</NextContinuationToken>")
    elif snapshot is not None:
      self._listings.pop(snapshot, None)
    for name, st in page:
      if st is None:
        parts.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
      else:
        parts.append(f"<Contents><Key>{escape(name)}</Key><LastModified>"
                     f"{_iso_date(st.st_mtime_ns)}</LastModified><ETag>{escape(etag_of(st))}"
                     f"</ETag><Size>{st.st_size}</Size><StorageClass>STANDARD</StorageClass>"
                     "</Contents>")
    parts.append("</ListBucketResult>")
    return 200, "Content-Type: application/xml\r\n", "".join(parts).encode(), -1

  # -- control -------------------------------------------------------------------

  def control(self, req: _Request) -> Answer:
    """`GET /_standin/stats`; `POST /_standin/config` (JSON: options to
    change, and `"reset": true` to reset the stats); `POST /_standin/reset`."""
    try:
      if req.method == "GET" and req.path == CONTROL + "stats":
        body: Any = {**self.stats.as_dict(), "kind": self.kind,
                     "options": dataclasses.asdict(self.options)}
      elif req.method == "POST" and req.path == CONTROL + "config":
        changes = json.loads(bytes(req.sink or b"{}") or b"{}")
        reset = changes.pop("reset", False)
        self.configure(changes)
        if reset:
          self.stats.reset()
        body = {"options": dataclasses.asdict(self.options)}
      elif req.method == "POST" and req.path == CONTROL + "reset":
        self.stats.reset()
        body = {}
      else:
        return 404, "Content-Type: application/json\r\n", b'{"error": "no such control"}', -1
    except (ValueError, TypeError) as e:
      return (400, "Content-Type: application/json\r\n",
              json.dumps({"error": str(e)}).encode(), -1)
    return 200, "Content-Type: application/json\r\n", json.dumps(body).encode(), -1


class _Connection(asyncio.Protocol):
  """One client connection: requests parsed as their bytes come, answered
  one at a time in order (the next is parsed once this one's body is out)."""

  # States: reading a request's head; its body; answering it.
  _HEAD, _BODY, _ANSWER = 0, 1, 2

  def __init__(self, store: _Store):
    self.store = store
    self.transport: Any = None
    self.buf = b""
    self.state = self._HEAD
    self.req: _Request | None = None
    self.body_left = 0
    self.closed = False
    self.parsing = False
    self.reading = True
    self.writable = True
    self.waiting: Callable[[], None] | None = None  # resumes a body once writes drain
    self.timer: asyncio.TimerHandle | None = None
    self.file_body: _FileBody | None = None
    self.next_write_at = 0.0  # bytes_per_s pacing
    self.counted = False  # this request is counted in flight

  def connection_made(self, transport: Any) -> None:
    self.transport = transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
      try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      except OSError:
        pass

  def connection_lost(self, exc: Exception | None) -> None:
    self.closed = True
    if self.timer is not None:
      self.timer.cancel()
      self.timer = None
    if self.file_body is not None:
      self.file_body.close()
      self.file_body = None
    req = self.req
    if req is not None and isinstance(req.sink, _FileSink):
      req.sink.discard()
    if self.counted:
      self.counted = False
      self.store.stats.end()

  def pause_writing(self) -> None:
    self.writable = False

  def resume_writing(self) -> None:
    self.writable = True
    waiting, self.waiting = self.waiting, None
    if waiting is not None:
      waiting()

  def data_received(self, data: bytes) -> None:
    if self.state == self._BODY:
      data = self._take_body(data)
      if self.state == self._BODY:
        return
    if data:
      self.buf = self.buf + data if self.buf else data
    if self.state == self._HEAD:
      self._parse()
    elif len(self.buf) > 1 << 20 and self.reading:
      self.reading = False
      self.transport.pause_reading()

  def _take_body(self, data: bytes) -> bytes:
    """Feeds the body its bytes from `data`; what is left belongs to the next request."""
    n = self.body_left
    chunk, rest = (data, b"") if len(data) <= n else (data[:n], data[n:])
    sink = self.req.sink
    if sink is not None:
      if isinstance(sink, _FileSink):
        sink.write(chunk)
      else:
        sink += chunk
    self.body_left = n - len(chunk)
    if not self.body_left:
      self._complete()
    return rest

  def _parse(self) -> None:
    if self.parsing:
      return
    self.parsing = True
    try:
      while self.state == self._HEAD and not self.closed and self.buf:
        buf = self.buf
        end = buf.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4)
        if end < 0:
          if len(buf) > MAX_HEADER_BYTES:
            self._refuse(431, "RequestHeaderSectionTooLarge",
                         f"request headers over {MAX_HEADER_BYTES} bytes")
          return
        lines = buf[:end].decode("latin-1").split("\r\n")
        self.buf = buf[end + 4:]
        request_line = lines[0].split(" ")
        if len(request_line) != 3 or not request_line[2].startswith("HTTP/1."):
          if not lines[0]:  # a stray blank line between requests
            self.buf = buf[2:]
            continue
          self._refuse(400, "BadRequest", "malformed request line")
          return
        headers = {}
        for line in lines[1:]:
          name, sep, value = line.partition(":")
          if not sep:
            self._refuse(400, "BadRequest", "malformed header")
            return
          headers[name.strip().lower()] = value.strip()
        req = self.req = _Request(request_line[0], request_line[1], headers)
        if request_line[2] == "HTTP/1.0" or headers.get("connection", "").lower() == "close":
          req.close = True
        if "transfer-encoding" in headers:
          self._refuse(501, "NotImplemented", "Transfer-Encoding is not supported")
          return
        try:
          length = int(headers.get("content-length", 0) or 0)
          if length < 0:
            raise ValueError(length)
        except ValueError:
          self._refuse(400, "BadRequest", "bad Content-Length")
          return
        try:
          self.store.begin(req)
        except Exception as e:  # pylint: disable=broad-except
          req.early = _error(500, "InternalError", f"{type(e).__name__}: {e}")
          req.close = True
        if not req.control:
          self.store.stats.begin()
          self.counted = True
        if req.close and req.early is not None and length:
          self._complete()  # refused before the body: not read, the connection closed
          return
        if length:
          if headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
          self.state = self._BODY
          self.body_left = length
          rest, self.buf = self.buf, b""
          rest = self._take_body(rest) if rest else rest
          if rest:
            self.buf = rest
          if self.state == self._BODY:
            return
        else:
          self._complete()
    finally:
      self.parsing = False

  def _refuse(self, status: int, code: str, message: str) -> None:
    """Answers a request that cannot be parsed, and closes."""
    _, headers, body, _ = _error(status, code, message)
    self.transport.write(f"{_STATUS_LINES[status]}{headers}Content-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
    self.store.stats.statuses[status] = self.store.stats.statuses.get(status, 0) + 1
    self.buf = b""
    self.closed = True
    self.transport.close()

  def _complete(self) -> None:
    """The request is in: answer it, after its time to first byte."""
    req = self.req
    self.state = self._ANSWER
    store = self.store
    if isinstance(req.sink, _FileSink) and req.early is None:
      req.sink.close()
    if req.control:
      self._send(req.early or store.control(req))
      return
    answer = store.answer(req)
    delay = store.ttfb()
    if delay > 0:
      stats = store.stats
      stats.ttfb_draws += 1
      stats.ttfb_sum_s += delay
      self.timer = store.loop.call_later(delay, self._send, answer)
    else:
      self._send(answer)

  def _send(self, answer: Answer) -> None:
    self.timer = None
    if self.closed:
      if not isinstance(answer[2], (bytes, bytearray)):
        answer[2].close()
      return
    status, headers, body, length = answer
    req = self.req
    if length == NO_LENGTH:  # the body ends with the connection
      req.close = True
    store = self.store
    if not req.control:
      statuses = store.stats.statuses
      statuses[status] = statuses.get(status, 0) + 1
    is_file = not isinstance(body, (bytes, bytearray))  # read in pieces
    if length < 0 and length != NO_LENGTH:
      length = body.length if is_file else len(body)
    framing = "" if length == NO_LENGTH else f"Content-Length: {length}\r\n"
    head = (f"{_STATUS_LINES[status]}{headers}{framing}"
            f"{'Connection: close' + chr(13) + chr(10) if req.close else ''}\r\n").encode()
    if req.method == "HEAD" or status in (204, 304):
      if is_file:
        body.close()
      self.transport.write(head)
      self._finish()
      return
    if req.control:
      self.transport.write(head + body)
      self._finish()
      return
    if not is_file and not store.options.bytes_per_s:
      self.transport.write(head + body if body else head)
      store.stats.body_bytes += len(body)
      self._finish()
      return
    self.transport.write(head)
    if not is_file:
      body = _BytesBody(body)
    self.file_body = body
    self._pump()

  def _pump(self) -> None:
    """Writes the body in pieces, as the connection drains and as
    `bytes_per_s` allows."""
    self.timer = None
    body = self.file_body
    store = self.store
    while body.length > 0 and not self.closed:
      if not self.writable:
        self.waiting = self._pump
        return
      n = min(body.length, PIECE)
      rate = store.options.bytes_per_s
      if rate:
        now = store.loop.time()
        if self.next_write_at > now:
          self.timer = store.loop.call_later(self.next_write_at - now, self._pump)
          return
        n = min(n, max(1, int(rate / 100)))  # ~10 ms of bytes
        self.next_write_at = max(now, self.next_write_at) + n / rate
      data = body.read(n)
      if len(data) != n:  # rewritten in place while it was sent: cut it short, as a reset
        self.transport.abort()
        return
      self.transport.write(data)
      store.stats.body_bytes += n
    if self.closed:
      return
    self.file_body = None
    body.close()
    self._finish()

  def _finish(self) -> None:
    """The answer is out: on to the next request, or close."""
    if self.counted:
      self.counted = False
      self.store.stats.end()
    close = self.req.close
    self.req = None
    if close:
      self.closed = True
      self.transport.close()
      return
    self.state = self._HEAD
    if not self.reading:
      self.reading = True
      self.transport.resume_reading()
    if self.buf:
      self._parse()


def new_event_loop() -> asyncio.AbstractEventLoop:
  """uvloop's where installed (several times asyncio's rate here)."""
  try:
    import uvloop  # pylint: disable=g-import-not-at-top
  except ImportError:
    return asyncio.new_event_loop()
  return uvloop.new_event_loop()


async def start(root: str, kind: str, options: Options, host: str = "127.0.0.1",
                port: int = 0) -> tuple[asyncio.AbstractServer, _Store]:
  """Serves `root` on the running loop; returns the server and its store."""
  loop = asyncio.get_running_loop()
  store = _Store(root, kind, options, loop)
  server = await loop.create_server(lambda: _Connection(store), host, port, backlog=1024,
                                    reuse_address=True)
  return server, store


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m grain_elevator.tools.testing.object_store",
      description="A folder served as S3 or GCS (XML API) buckets on 127.0.0.1.")
  parser.add_argument("--root", required=True, help="folder of buckets: ROOT/BUCKET/KEY")
  parser.add_argument("--kind", choices=KINDS, default="s3")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=0, help="0: a free port")
  parser.add_argument("--ttfb-p50-ms", type=float, default=DEFAULT_TTFB_P50_MS)
  parser.add_argument("--ttfb-p99-ms", type=float, default=DEFAULT_TTFB_P99_MS)
  parser.add_argument("--ttfb", type=float, default=None, help="0: no delay")
  parser.add_argument("--max-rate", type=float, default=0.0,
                      help="requests/s per prefix; 0: unlimited")
  parser.add_argument("--bytes-per-s", type=float, default=0.0, help="per connection")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-object-bytes", type=int, default=DEFAULT_MAX_OBJECT_BYTES)
  parser.add_argument("--lie", choices=LIES, default="",
                      help="answer ranged GETs wrongly, this way (tests of a store that lies)")
  parser.add_argument("--lie-bytes", type=int, default=DEFAULT_LIE_BYTES,
                      help='an "oversized" answer\'s Content-Length')
  args = parser.parse_args(argv)
  options = Options()
  changes: dict[str, Any] = {
      "ttfb_p50_ms": args.ttfb_p50_ms, "ttfb_p99_ms": args.ttfb_p99_ms,
      "max_rate": args.max_rate, "bytes_per_s": args.bytes_per_s, "seed": args.seed,
      "max_object_bytes": args.max_object_bytes, "lie": args.lie, "lie_bytes": args.lie_bytes}
  if args.ttfb is not None:
    changes["ttfb"] = args.ttfb
  try:
    options.update(changes)
  except ValueError as e:
    parser.error(str(e))
  loop = new_event_loop()
  asyncio.set_event_loop(loop)
  server, _ = loop.run_until_complete(start(args.root, args.kind, options, args.host, args.port))
  port = server.sockets[0].getsockname()[1]
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, loop.stop)
  print(f"listening on http://{args.host}:{port}", flush=True)
  try:
    loop.run_forever()
  finally:
    server.close()
    loop.close()


# -- the client side: a store in a subprocess (or a thread) ---------------------

_KEY: str | None = None


def _service_account_key() -> str:
  """A service-account key of our own: obstore's GCSStore wants a bearer
  token to write even where it reads unsigned, and with `disable_oauth` it
  signs one itself from the key instead of asking a token endpoint."""
  global _KEY
  if _KEY is None:
    from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top
    from cryptography.hazmat.primitives.asymmetric import rsa  # pylint: disable=g-import-not-at-top
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    _KEY = json.dumps({"private_key": pem, "private_key_id": "standin",
                       "client_email": "tests@standin.iam.gserviceaccount.com",
                       "disable_oauth": True})
  return _KEY


class StandInStore:
  """The stand-in store serving `root` (a folder; BUCKET/KEY under it), by
  default in a subprocess of this Python tied to this process (so its CPU is
  not the reader's), or in a thread of this one (`in_thread=True`). `options`
  are Options' fields, or `ttfb=0`. A context manager."""

  ACCESS_KEY = "standin-key"
  SECRET_KEY = "standin-secret-0123456789"

  def __init__(self, root: str | os.PathLike, kind: str = "s3", *, in_thread: bool = False,
               **options: Any):
    if kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    self.root = os.fspath(root)
    self.kind = kind
    os.makedirs(self.root, exist_ok=True)
    Options().update(options)  # a bad option fails here, not in the child
    self.proc: subprocess.Popen | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    if in_thread:
      self.port = self._start_thread(options)
    else:
      self.port = self._start_process(options)
    self._wait_answers()

  def _start_process(self, options: dict[str, Any]) -> int:
    argv = [sys.executable, "-m", "grain_elevator.tools.testing.object_store", "--root",
            self.root, "--kind", self.kind, "--port", "0"]
    for name, value in options.items():
      argv += [f"--{name.replace('_', '-')}", str(value)]
    self.proc = subprocess.Popen(lifeline.tied(argv), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    self._stderr: list[str] = []
    threading.Thread(target=self._drain, daemon=True, name="standin-stderr").start()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    line = lines[0] if lines else ""
    if not line.startswith("listening on http://"):
      self.stop()
      raise RuntimeError(f"the stand-in store did not start ({line!r}):\n"
                         + "".join(self._stderr)[-2000:])
    return int(line.strip().rpartition(":")[2])

  def _drain(self) -> None:
    for line in self.proc.stderr:
      self._stderr.append(line)
      del self._stderr[:-200]

  def _start_thread(self, options: dict[str, Any]) -> int:
    opts = Options()
    opts.update(options)
    loop = self._loop = new_event_loop()
    started: list[Any] = []
    ready = threading.Event()

    def run() -> None:
      asyncio.set_event_loop(loop)
      try:
        started.append(loop.run_until_complete(start(self.root, self.kind, opts)))
      except BaseException as e:  # pylint: disable=broad-except
        started.append(e)
      ready.set()
      if not isinstance(started[0], BaseException):
        loop.run_forever()
        started[0][0].close()
      loop.close()

    self._thread = threading.Thread(target=run, daemon=True, name="standin-store")
    self._thread.start()
    ready.wait()
    if isinstance(started[0], BaseException):
      raise started[0]
    return started[0][0].sockets[0].getsockname()[1]

  def _wait_answers(self) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
      try:
        self.stats()
        return
      except OSError:
        if time.monotonic() > deadline:
          self.stop()
          raise
        time.sleep(0.05)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  @property
  def pid(self) -> int:
    return self.proc.pid if self.proc is not None else os.getpid()

  def env(self) -> dict[str, str]:
    """The variables a client (settings.py's build_store) needs: S3's
    endpoint, keys (any) and region; GCS's emulator host (unsigned reads) and
    a key to sign its writes' tokens with."""
    if self.kind == "s3":
      return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
              "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_REGION": "us-east-1"}
    return {"STORAGE_EMULATOR_HOST": self.url,
            "GOOGLE_SERVICE_ACCOUNT_KEY": _service_account_key()}

  def create_bucket(self, name: str) -> None:
    os.makedirs(os.path.join(self.root, name), exist_ok=True)

  def put(self, bucket: str, key: str, data: bytes) -> None:
    """Writes the object's file directly (atomically), as a PUT would."""
    if _bad_key(key):
      raise ValueError(f"key {key!r} cannot be stored")
    path = os.path.join(self.root, bucket, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f"{HIDDEN}{secrets.token_hex(8)}")
    with open(tmp, "wb") as f:
      f.write(data)
    try:
      previous = os.stat(path).st_mtime_ns
    except FileNotFoundError:
      previous = 0
    _bump_mtime(tmp, previous)
    os.replace(tmp, path)

  def delete(self, bucket: str, key: str) -> None:
    os.unlink(os.path.join(self.root, bucket, key))

  def _control(self, method: str, name: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{self.url}{CONTROL}{name}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
    except urllib.error.HTTPError as e:
      raise ValueError(json.loads(e.read()).get("error", str(e))) from None

  def stats(self) -> dict[str, Any]:
    """The server's counters since the last reset (Stats.as_dict), its kind and options."""
    return self._control("GET", "stats")

  def configure(self, reset: bool = False, **options: Any) -> dict[str, Any]:
    """Changes options at run time (`ttfb=0`, `ttfb_p50_ms=`, `max_rate=`...);
    `reset` resets the stats. Returns the options now in force."""
    return self._control("POST", "config", {**options, "reset": reset})["options"]

  def reset_stats(self) -> None:
    self._control("POST", "reset", {})

  def stop(self) -> None:
    if self.proc is not None:
      storage_servers.end(self.proc)
      self.proc.stdout.close()
    if self._loop is not None and self._thread is not None and self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(10)

  def __enter__(self) -> "StandInStore":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.stop()


if __name__ == "__main__":
  main()
