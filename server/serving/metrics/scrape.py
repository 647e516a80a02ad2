"""The `/metrics` endpoint's HTTP server, bounded like every transport.

It answers each connection on a thread of its own: a read or write that
waits SCRAPE_TIMEOUT_S closes the connection, and at most
MAX_SCRAPE_CONNECTIONS are open at once. A newcomer beyond that closes the
one that has waited longest for its request to arrive (a peer that sends
half a request yields to a scraper), or is closed itself when every one is
being answered.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from typing import Any
from wsgiref import simple_server

log = logging.getLogger("grain_elevator.server")

# A scrape takes milliseconds; a connection whose read or write waits this
# long is closed.
SCRAPE_TIMEOUT_S = 10.0
# Prometheus scrapes a target once per interval, a few scrapers at most.
MAX_SCRAPE_CONNECTIONS = 16

class _Quiet:
  """wsgiref's error stream, which gets a traceback for each peer that timed
  out: at debug level, so slow peers cannot flood the log."""

  def write(self, text: str) -> None:
    log.debug("metrics endpoint: %s", text.rstrip())

  def flush(self) -> None:
    pass


class _ScrapeHandler(simple_server.WSGIRequestHandler):
  """One scrape: reads and writes time out; no access log."""

  server: ScrapeServer

  def setup(self) -> None:
    self.timeout = self.server.timeout_s  # StreamRequestHandler sets it on the socket
    super().setup()

  def parse_request(self) -> bool:
    ok = super().parse_request()
    self.server.request_read(self.request)
    return ok

  def get_stderr(self) -> Any:
    return _Quiet()

  def log_message(self, format: str, *args: Any) -> None:  # pylint: disable=redefined-builtin
    pass


class ScrapeServer(socketserver.ThreadingMixIn, simple_server.WSGIServer):
  """prometheus_client's threaded WSGI server with its connections bounded
  (the module docstring says how)."""

  daemon_threads = True
  request_queue_size = 64

  def __init__(self, host: str, port: int, app: Any, *, timeout_s: float,
               max_connections: int):
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    self.address_family = family
    self.timeout_s = timeout_s
    self.max_connections = max_connections
    self._lock = threading.Lock()
    self._open: set[socket.socket] = set()
    self._arriving: dict[socket.socket, float] = {}  # open, request not yet read
    super().__init__(address[:2], _ScrapeHandler)
    self.set_app(app)

  def process_request(self, request: Any, client_address: Any) -> None:
    with self._lock:
      if len(self._open) >= self.max_connections:
        oldest = min(self._arriving, key=self._arriving.__getitem__, default=None)
        if oldest is None:  # every one is being answered: this one waits its turn
          self.shutdown_request(request)
          return
        self._drop(oldest)
        _hang_up(oldest)  # its thread wakes from its read and ends
      self._open.add(request)
      self._arriving[request] = time.monotonic()
    try:
      super().process_request(request, client_address)
    except BaseException:
      with self._lock:
        self._drop(request)
      raise

  def process_request_thread(self, request: Any, client_address: Any) -> None:
    try:
      self.finish_request(request, client_address)
    except Exception:  # pylint: disable=broad-except
      self.handle_error(request, client_address)
    finally:
      with self._lock:  # before the close: a newcomer never hangs up a closed socket
        self._drop(request)
      self.shutdown_request(request)

  def request_read(self, request: Any) -> None:
    with self._lock:
      self._arriving.pop(request, None)

  def _drop(self, request: Any) -> None:
    self._open.discard(request)
    self._arriving.pop(request, None)

  def handle_error(self, request: Any, client_address: Any) -> None:
    log.debug("metrics endpoint: the connection from %s failed", client_address,
              exc_info=True)

  def server_close(self) -> None:
    super().server_close()
    with self._lock:
      for request in list(self._open):
        self._drop(request)
        _hang_up(request)


def _hang_up(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


def serve(host: str, port: int, app: Any, *, timeout_s: float,
          max_connections: int) -> ScrapeServer:
  """Serves `app` on host:port (0: a free port) from a thread of its own."""
  http = ScrapeServer(host, port, app, timeout_s=timeout_s, max_connections=max_connections)
  threading.Thread(target=http.serve_forever, daemon=True, name="elevator-metrics-http").start()
  return http
