"""An HTTP proxy in front of a storage server that injects latency and
faults and counts what it forwards: for the bucket tests and the storage
bench, on 127.0.0.1 only.

Each request is delayed by `latency_s`, then answered by the next fault
queued (`inject`), or, during an outage (`outage(seconds)`), by the
outage's fault, or else forwarded. Faults: "503" and "429" (a status and an
empty body), "reset" (the connection closed with an RST, nothing sent),
"stall" (nothing sent for `stall_s`, then an RST), "truncate" (the response's
headers, half its body, then an RST). `faults_only_for` limits faults to
requests whose method and path match (ranged GETs of shards, say).
`stats` counts requests, faults and body bytes sent back.

`gcs_xml=True`: the upstream is gcp-storage-emulator, which speaks GCS's
JSON API, and the client obstore, which reads GCS through its XML API
(list, HEAD, GET with ETag, Last-Modified and x-goog-generation headers,
If-Match and `generation=` conditions; PUT of a whole object and DELETE,
which the converters use, but not multipart uploads). The proxy answers
those calls from the emulator's JSON metadata and its download and upload
endpoints; the emulator's own XML GET sends none of those headers.

As a command, for trying the server against gcp-storage-emulator by hand
(docs/buckets.md, "GCS emulators"):

    gcp-storage-emulator start --port 9023 --in-memory
    python -m grain_elevator.tools.testing.fault_proxy --gcs-xml http://127.0.0.1:9023
    # its first line names the URL to give STORAGE_EMULATOR_HOST
"""

from __future__ import annotations

import argparse
import dataclasses
import email.utils
import http.client
import http.server
import json
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.parse
from typing import Callable
from xml.sax.saxutils import escape

FAULTS = ("503", "429", "reset", "stall", "truncate")


@dataclasses.dataclass
class Stats:
  requests: int = 0
  faults: int = 0
  body_bytes: int = 0
  ranged_gets: int = 0


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
  daemon_threads = True
  allow_reuse_address = True
  # A worker opens up to MAX_IN_FLIGHT connections at once (server/data/storage/
  # objects.py): a listen backlog of 5 would drop their SYNs, each a second lost.
  request_queue_size = 256
  proxy: "FaultProxy"

  def handle_error(self, request, client_address) -> None:
    """A client that closed a kept-alive connection (between requests, where
    the handler's own catch does not reach) is not an error; the rest are."""
    if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      super().handle_error(request, client_address)


class FaultProxy:
  """Listens on 127.0.0.1 (a free port) and forwards to `upstream` (an
  http://host:port URL); thread-safe."""

  def __init__(self, upstream: str, *, gcs_xml: bool = False, latency_s: float = 0.0,
               stall_s: float = 5.0, host: str = "127.0.0.1", port: int = 0):
    parsed = urllib.parse.urlsplit(upstream)
    self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
    self.gcs_xml = gcs_xml
    self.latency_s = latency_s
    self.stall_s = stall_s
    self.stats = Stats()
    self.faults_only_for: Callable[[str, str], bool] | None = None
    self._queue: list[str] = []
    self._outage: tuple[float, str] | None = None
    self._lock = threading.Lock()
    self._server = _Server((host, port), _Handler)
    self._server.proxy = self
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                    name="fault-proxy")
    self._thread.start()

  @property
  def url(self) -> str:
    host = self._server.server_address[0]
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self._server.server_address[1]}"

  def inject(self, *faults: str) -> None:
    """Queues faults, one per matching request from now on."""
    for f in faults:
      if f not in FAULTS:
        raise ValueError(f"unknown fault {f!r}; one of {FAULTS}")
    with self._lock:
      self._queue.extend(faults)

  def outage(self, seconds: float, fault: str = "503") -> None:
    """Every matching request for `seconds` from now is answered by `fault`."""
    with self._lock:
      self._outage = (time.monotonic() + seconds, fault)

  def clear(self) -> None:
    with self._lock:
      self._queue.clear()
      self._outage = None

  def pending_faults(self) -> int:
    with self._lock:
      return len(self._queue)

  def _fault_for(self, method: str, path: str) -> str | None:
    if self.faults_only_for is not None and not self.faults_only_for(method, path):
      return None
    with self._lock:
      if self._outage is not None:
        until, fault = self._outage
        if time.monotonic() < until:
          return fault
        self._outage = None
      return self._queue.pop(0) if self._queue else None

  def _count(self, **deltas: int) -> None:
    with self._lock:
      for k, v in deltas.items():
        setattr(self.stats, k, getattr(self.stats, k) + v)

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _http_date(iso: str) -> str:
  """RFC 3339 ("2026-11-28T05:00:29.361184Z") as an HTTP date."""
  t = time.strptime(iso.split(".")[0].rstrip("Z"), "%Y-%m-%dT%H:%M:%S")
  return email.utils.formatdate(time.mktime(t) - time.timezone, usegmt=True)


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: _Server

  def log_message(self, format, *args) -> None:  # pylint: disable=redefined-builtin
    pass

  def _upstream(self) -> http.client.HTTPConnection:
    conn = getattr(self, "_conn", None)
    if conn is None:
      conn = self._conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=60)
    return conn

  def _forward_raw(self, method: str, path: str, body: bytes | None,
                   headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
    for attempt in range(2):  # an idle upstream connection may have closed
      conn = self._upstream()
      try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        return r.status, r.getheaders(), data
      except (http.client.HTTPException, OSError):
        conn.close()
        self._conn = None
        if attempt:
          raise
    raise AssertionError("unreachable")

  def _reset(self) -> None:
    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    self.close_connection = True
    try:
      self.connection.close()
    except OSError:
      pass

  def _send(self, status: int, headers: list[tuple[str, str]], body: bytes,
            truncate: bool = False) -> None:
    proxy = self.server.proxy
    self.send_response(status)
    skip = {"content-length", "transfer-encoding", "connection", "server", "date"}
    length = str(len(body))
    for k, v in headers:
      if k.lower() not in skip:
        self.send_header(k, v)
      elif k.lower() == "content-length" and self.command == "HEAD":
        length = v  # the object's, not this empty body's
    self.send_header("Content-Length", length)
    self.end_headers()
    if self.command != "HEAD":
      if truncate:
        self.wfile.write(body[:len(body) // 2])
        self.wfile.flush()
        proxy._count(body_bytes=len(body) // 2)  # pylint: disable=protected-access
        self._reset()
        return
      self.wfile.write(body)
      proxy._count(body_bytes=len(body))  # pylint: disable=protected-access

  def _handle(self) -> None:
    proxy = self.server.proxy
    length = int(self.headers.get("Content-Length") or 0)
    body = self.rfile.read(length) if length else None
    proxy._count(requests=1, ranged_gets=int(  # pylint: disable=protected-access
        self.command == "GET" and "Range" in self.headers))
    if proxy.latency_s:
      time.sleep(proxy.latency_s)
    fault = proxy._fault_for(self.command, self.path)  # pylint: disable=protected-access
    if fault is not None:
      proxy._count(faults=1)  # pylint: disable=protected-access
      if fault in ("503", "429"):
        self._send(int(fault), [("Content-Type", "text/plain")], b"")
        return
      if fault == "stall":
        time.sleep(proxy.stall_s)
      if fault in ("reset", "stall"):
        self._reset()
        return
    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
    if proxy.gcs_xml:
      status, out_headers, data = self._gcs(body, headers)
    else:
      status, out_headers, data = self._forward_raw(self.command, self.path, body, headers)
    self._send(status, out_headers, data, truncate=fault == "truncate")

  def _handle_quietly(self) -> None:
    try:
      self._handle()
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
      self.close_connection = True

  do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle_quietly

  # -- GCS's XML API from the emulator's JSON API ----------------------------

  def _json(self, path: str) -> tuple[int, dict]:
    status, _, data = self._forward_raw("GET", path, None, {})
    try:
      return status, json.loads(data or b"{}")
    except ValueError:
      return status, {}

  def _gcs(self, body: bytes | None, headers: dict[str, str]
           ) -> tuple[int, list[tuple[str, str]], bytes]:
    url = urllib.parse.urlsplit(self.path)
    parts = url.path.lstrip("/").split("/", 1)
    query = urllib.parse.parse_qs(url.query)
    if url.path.startswith(("/storage/", "/upload/", "/download/")) or not parts[0]:
      return self._forward_raw(self.command, self.path, body, headers)  # JSON API as is
    bucket = urllib.parse.unquote(parts[0])
    key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
    if self.command == "GET" and not key:
      return self._gcs_list(bucket, query)
    if self.command == "PUT" and key and not url.query:  # a whole object (no multipart)
      status, _, data = self._forward_raw(
          "POST", f"/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?uploadType="
          f"media&name={urllib.parse.quote(key, safe='')}", body or b"",
          {"Content-Type": "application/octet-stream"})
      if status != 200:
        return status, [], b""
      meta = json.loads(data)
      return 200, [("ETag", f'"{meta["md5Hash"]}"'),
                   ("x-goog-generation", meta["generation"])], b""
    if self.command == "DELETE" and key:
      status, _, _ = self._forward_raw(
          "DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}", None, {})
      return (204 if status in (200, 204) else status), [], b""
    if self.command not in ("GET", "HEAD"):
      return 501, [], b""
    status, meta = self._json(f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")
    if status != 200:
      return status, [("Content-Type", "application/xml")], (
          b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code></Error>")
    etag = f'"{meta["md5Hash"]}"'
    generation = meta["generation"]
    want_generation = query.get("generation", [None])[0]
    if want_generation is not None and want_generation != generation:
      return 404, [], b""
    if_match = headers.get("If-Match") or headers.get("if-match")
    if if_match is not None and if_match not in ("*", etag):
      return 412, [], b""
    out = [("ETag", etag), ("Last-Modified", _http_date(meta["updated"])),
           ("x-goog-generation", generation), ("Content-Type", "application/octet-stream")]
    if self.command == "HEAD":
      return 200, out + [("Content-Length", meta["size"])], b""
    ranged = {k: v for k, v in headers.items() if k.lower() == "range"}
    status, got, data = self._forward_raw(
        "GET", f"/download/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"
        f"?alt=media", None, ranged)
    # Replaced between the metadata and the download: as GCS, never mixed.
    _, after = self._json(f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")
    if after.get("generation") != generation:
      return 412 if if_match else 404, [], b""
    content_range = [(k, v) for k, v in got if k.lower() == "content-range"]
    return status, out + content_range, data

  def _gcs_list(self, bucket: str, query: dict[str, list[str]]
                ) -> tuple[int, list[tuple[str, str]], bytes]:
    prefix = query.get("prefix", [""])[0]
    delimiter = query.get("delimiter", [None])[0]
    items: list[dict] = []
    prefixes: list[str] = []
    token = ""
    for _ in range(10_000):  # pages, bounded
      q = {"prefix": prefix, **({"pageToken": token} if token else {}),
           **({"delimiter": delimiter} if delimiter else {})}
      status, page = self._json(f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(q)}")
      if status != 200:
        return status, [("Content-Type", "application/xml")], (
            b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchBucket</Code></Error>")
      items += page.get("items", [])
      prefixes += page.get("prefixes", [])
      token = page.get("nextPageToken", "")
      if not token:
        break
    contents = "".join(
        f"<Contents><Key>{escape(i['name'])}</Key><Size>{i['size']}</Size>"
        f"<LastModified>{i['updated']}</LastModified>"
        f"<ETag>&quot;{escape(i['md5Hash'])}&quot;</ETag></Contents>" for i in items)
    common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>"
                     for p in prefixes)
    xml = (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult>"
           f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
           f"<KeyCount>{len(items)}</KeyCount><IsTruncated>false</IsTruncated>"
           f"{contents}{common}</ListBucketResult>")
    return 200, [("Content-Type", "application/xml")], xml.encode()


# -- the command -------------------------------------------------------------------


def _upstream_url(text: str) -> str:
  parsed = urllib.parse.urlsplit(text)
  if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
    raise argparse.ArgumentTypeError(
        f"expected the store's URL as http://HOST:PORT (plain HTTP, no path), got {text!r}")
  try:
    parsed.port  # pylint: disable=pointless-statement
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
  return text


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m grain_elevator.tools.testing.fault_proxy",
      description="Forward HTTP to a local object store. With --gcs-xml, answer the GCS XML "
                  "API calls the server makes (list, HEAD, ranged GET, PUT, DELETE) from "
                  "gcp-storage-emulator's JSON API, which the emulator alone does not serve "
                  "(a server pointed at it directly fails listing with HTTP 501). Prints "
                  "the URL for STORAGE_EMULATOR_HOST, then runs until SIGINT or SIGTERM. "
                  "For tests and trials: no TLS, no authentication.")
  p.add_argument("upstream", type=_upstream_url,
                 help="the store, http://HOST:PORT (gcp-storage-emulator's --port)")
  p.add_argument("--gcs-xml", action="store_true",
                 help="translate GCS's XML API to the upstream's JSON API (for "
                      "gcp-storage-emulator); without it, forward as is")
  p.add_argument("--host", default="127.0.0.1",
                 help="address to listen on (default %(default)s)")
  p.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
  p.add_argument("--latency-s", type=float, default=0.0,
                 help="delay added to each request, in seconds (default %(default)s)")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  stop = {signal.SIGINT, signal.SIGTERM}
  # Blocked before the proxy's threads start, so that they inherit the mask
  # and the main thread alone takes the signal, in sigwait.
  signal.pthread_sigmask(signal.SIG_BLOCK, stop)
  try:
    proxy = FaultProxy(args.upstream, gcs_xml=args.gcs_xml, latency_s=args.latency_s,
                       host=args.host, port=args.port)
  except OSError as e:
    print(f"fault_proxy: error: cannot listen on {args.host}:{args.port}: {e.strerror}",
          file=sys.stderr)
    return 2
  with proxy:
    what = "GCS XML API" if args.gcs_xml else "HTTP"
    print(f"STORAGE_EMULATOR_HOST={proxy.url}  # {what} on {proxy.url}, from {args.upstream}",
          flush=True)
    signal.sigwait(stop)
  return 0


if __name__ == "__main__":
  sys.exit(main())
