"""The gRPC port's front door: with a token set, a connection that has made
no authenticated call is closed soon after it opens.

gRPC accepts a worker's connections itself, up to `--max-grpc-connections`,
and offers no hook where one is accepted: the token comes only with a
connection's first call. So one address could hold every connection a worker
accepts by opening them and calling nothing with the token, and a trainer
with the token was refused until they went idle (`--idle-timeout-s`).

`FrontDoor` finds the worker's own connections on the gRPC port among its
descriptors (/proc/self/fd, every SWEEP_S), hears from the auth interceptor
(server/serving/grpc_service.py) the peer of each call that carried the
token, and shuts down each connection that has carried none within
UNAUTHENTICATED_GRACE_S of being found: gRPC then tears its transport down
and gives its place under the cap to the next newcomer. A client with the
token makes its first call as soon as it connects, so it is never closed.

What it cannot do is refuse at accept: an address that opens a new
connection the moment one is closed still competes for the places freed
(docs/operations.md, "Limits and security"). Linux only: elsewhere it says
so once and does nothing.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
import urllib.parse

from grain_elevator.proto.throttle import Throttled

log = logging.getLogger("grain_elevator.server")
# A gRPC client sends its first call right after the HTTP/2 handshake, and
# the interceptor hears of it when a handler thread takes the call up (ms,
# or up to the arrival deadline when every thread is busy): a second covers
# both, and frees a flood's places before a trainer's second reconnection
# (gRPC's reconnect backoff starts at 1 s, then 1.6x).
UNAUTHENTICATED_GRACE_S = 1.0
# How often the descriptors are looked through: ~3 us a descriptor (a
# worker holding 1,000 costs ~3 ms a sweep, ~1% of a core).
SWEEP_S = 0.25
# A note of an authenticated call whose connection the sweep has not found
# (yet) is kept this long.
_NOTE_KEEP_S = 10.0
_FDS = "/proc/self/fd"
_LOG_PERIOD_S = 10.0


def peer_key(peer: str) -> str | None:
  """A connection's remote end as "address:port", from gRPC's
  `context.peer()` ("ipv4:10.0.0.7:5123", "ipv6:[::1]:5123", or its
  percent-encoded "ipv6:%5B::1%5D:5123"); None for anything else (unix)."""
  kind, _, rest = urllib.parse.unquote(peer).partition(":")
  if kind not in ("ipv4", "ipv6"):
    return None
  address, _, port = rest.rpartition(":")
  return _key(address.strip("[]"), port)


def _key(address: str, port: object) -> str | None:
  """"address:port" with an IPv4-mapped IPv6 address (a dual-stack
  listener's view of an IPv4 peer) written as the IPv4 one, as gRPC does."""
  try:
    ip = ipaddress.ip_address(address.partition("%")[0])
  except ValueError:
    return None
  mapped = getattr(ip, "ipv4_mapped", None)
  return f"{mapped or ip}:{port}"


@dataclasses.dataclass
class _Connection:
  fd: int
  peer: str
  found: float  # when a sweep first saw it
  trusted: bool = False  # carried a call with the token


class FrontDoor:
  """Closes the worker's gRPC connections on `port` that carry no call with
  the token within `grace_s`. Thread-safe: `note` is called from handler
  threads, `sweep` from the door's own thread (or a test)."""

  def __init__(self, grace_s: float = UNAUTHENTICATED_GRACE_S, period_s: float = SWEEP_S):
    self.grace_s, self.period_s = grace_s, period_s
    self.port: int | None = None
    self.closed = 0  # connections shut down, in all
    self._lock = threading.Lock()  # guards _notes
    self._notes: dict[str, float] = {}  # peer -> when its authenticated call came
    # The sweeping thread's alone:
    self._connections: dict[int, _Connection] = {}  # by socket inode
    self._others: set[int] = set()  # socket inodes that are not such connections
    self._stop = threading.Event()
    self._log = Throttled(_LOG_PERIOD_S, log)

  def note(self, peer: str) -> None:
    """A call from `peer` (`context.peer()`) carried the server's token."""
    key = peer_key(peer)
    if key is not None:
      with self._lock:
        self._notes[key] = time.monotonic()

  def start(self, port: int) -> None:
    """Watches connections on local `port` from a daemon thread."""
    self.port = port
    if not os.path.isdir(_FDS):
      log.warning("%s is not readable here: a connection to the gRPC port that makes no "
                  "authenticated call stays until --idle-timeout-s", _FDS)
      return
    threading.Thread(target=self._run, name="elevator-front-door", daemon=True).start()

  def stop(self) -> None:
    self._stop.set()

  def _run(self) -> None:
    while not self._stop.wait(self.period_s):
      try:
        self.sweep()
      except Exception:  # pylint: disable=broad-except
        self._log.warning("sweep", "the gRPC port's front door failed a sweep",
                          exc_info=True)

  def sweep(self, now: float | None = None) -> int:
    """Finds the connections, trusts those noted, and shuts down those
    found over `grace_s` ago that are not trusted; how many were."""
    now = time.monotonic() if now is None else now
    seen = self._scan(now)
    for inode in list(self._connections):
      if inode not in seen:
        del self._connections[inode]
    with self._lock:
      for c in self._connections.values():
        if not c.trusted and c.peer in self._notes:
          c.trusted = True
          del self._notes[c.peer]
      for peer in [p for p, t in self._notes.items() if now - t > _NOTE_KEEP_S]:
        del self._notes[peer]
    closed = 0
    for inode, c in list(self._connections.items()):
      if not c.trusted and now - c.found >= self.grace_s:
        closed += _shut_down(c.fd, inode)
        del self._connections[inode]
    self.closed += closed
    if closed:
      self._log.warning("unauthenticated", "closed %d gRPC connection(s) that made no call "
                     "with the token within %gs of opening", closed, self.grace_s)
    return closed

  def _scan(self, now: float) -> set[int]:
    """Socket inodes among this process's descriptors; new ones are looked
    at once: a connection on the gRPC port is remembered, anything else
    (its listener, other ports, files) skipped from then on."""
    seen = set()
    with os.scandir(_FDS) as fds:
      for entry in fds:
        try:
          link = os.readlink(entry.path)
        except OSError:
          continue  # closed meanwhile
        if not link.startswith("socket:["):
          continue
        inode = int(link[8:-1])
        seen.add(inode)
        if inode in self._connections or inode in self._others:
          continue
        peer = self._peer_on_port(int(entry.name), inode)
        if peer is None:
          self._others.add(inode)
        else:
          self._connections[inode] = _Connection(int(entry.name), peer, now)
    self._others &= seen
    return seen

  def _peer_on_port(self, fd: int, inode: int) -> str | None:
    """The remote end of socket `fd` if it is a TCP connection accepted on
    the gRPC port (inode checked: the descriptor may have been reused)."""
    sock = _dup(fd, inode)
    if sock is None:
      return None
    with sock:
      try:
        if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != self.port:
          return None
        remote = sock.getpeername()
      except (OSError, IndexError, TypeError):
        return None  # a listener (not connected), or not an IP socket
    return _key(remote[0], remote[1])


def _dup(fd: int, inode: int) -> socket.socket | None:
  """A socket object on a copy of descriptor `fd`, if it still is socket
  `inode` (never the caller's descriptor itself: closing it is harmless)."""
  try:
    copy = os.dup(fd)
  except OSError:
    return None
  try:
    st = os.fstat(copy)
    if not stat.S_ISSOCK(st.st_mode) or st.st_ino != inode:
      os.close(copy)
      return None
    return socket.socket(fileno=copy)
  except OSError:
    os.close(copy)
    return None


def _shut_down(fd: int, inode: int) -> int:
  """Shuts connection `fd` down both ways (1), if it still is socket
  `inode` (else 0): its owner, gRPC, reads the end and closes it."""
  sock = _dup(fd, inode)
  if sock is None:
    return 0
  with sock:
    try:
      sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      return 0
  return 1
