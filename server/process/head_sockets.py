"""The Unix sockets on which a server's workers compute a stream's head together.

Each worker listens on a socket of its own in a private directory
(`HeadPeers`, which the supervisor makes and hands to every worker it
spawns; server/data/streams/parallel_head.py sees nothing else of this
module); the others dial it. Both ends prove they hold the
server's key with multiprocessing's challenge and response, then exchange
pickled messages: nothing crosses the network, and nothing is unpickled
from a peer before it has proved it holds the key.

A connection that has not finished its handshake is a stranger, and may be
anything: a worker killed mid-dial, a dial that gave up while the listener
was paused (SIGSTOP) and is accepted when it resumes, any process of the
same user. So the accept loop never does a handshake itself and never ends
on one: each runs on a thread of its own, bounded by the socket's kernel
timeouts (SO_RCVTIMEO, SO_SNDTIMEO) at HEAD_HANDSHAKE_TIMEOUT_S, at most
MAX_HEAD_HANDSHAKES at once (a newcomer beyond them is closed at once);
one that fails is closed, with one log line per HEAD_LOG_PERIOD_S, and the
loop goes on. A dial is bounded the same way, its connect included.

Kernel timeouts rather than Python's: multiprocessing's connections read and
write a blocking descriptor (os.read, os.write), which a Python socket
timeout would make non-blocking. A read past its timeout raises
BlockingIOError, a write past its timeout too; either leaves a message cut,
so the connection is closed.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import shutil
import socket
import struct
import threading
import tempfile
import time
from typing import Callable

from grain_elevator.proto.throttle import Throttled
from grain_elevator.server.data.streams.parallel_head import HEAD_LOG_PERIOD_S

log = logging.getLogger("grain_elevator.server")

# Connect and authentication, each way: a few round trips between two
# processes of one machine, milliseconds even under load.
HEAD_HANDSHAKE_TIMEOUT_S = 3.0
# Handshakes in progress at once on one worker's socket; the legitimate ones
# are one per other worker (each dials once, and again after a failure).
MAX_HEAD_HANDSHAKES = 32
# Connections the kernel queues until the accept loop takes them.
_BACKLOG = 16
# After accept itself fails (out of descriptors), before the next try.
_ACCEPT_BACKOFF_S = 0.1
# The longest AF_UNIX path Linux takes (sun_path is 108 bytes, NUL included).
_MAX_SOCKET_PATH = 107


class HeadPeers:
  """Where the server's workers meet: a private directory (mode 0700) with
  one socket per worker index, and the key that authenticates them. Made by
  the supervisor, handed to every worker it spawns (restarts included); the
  parallel head listens, dials and closes through it (parallel_head.Peers)."""

  def __init__(self, num_workers: int):
    self.num_workers = num_workers
    self.directory = tempfile.mkdtemp(prefix="elevator-head-")
    if len(self.address(num_workers)) > _MAX_SOCKET_PATH:
      # A long TMPDIR (a CI runner's, a pod's) would make the socket path
      # longer than AF_UNIX allows; /tmp is short everywhere.
      os.rmdir(self.directory)
      self.directory = tempfile.mkdtemp(prefix="elevator-head-", dir="/tmp")
    self.authkey = os.urandom(32)

  def address(self, index: int) -> str:
    return os.path.join(self.directory, f"{index}.sock")

  def remove(self) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)

  def listen(self, index: int, serve: Callable[[mpc.Connection], None], *,
             send_timeout_s: float | None) -> "Listener":
    """Worker `index`'s socket, each authenticated connection to `serve`."""
    return Listener(self.address(index), self.authkey, serve, send_timeout_s=send_timeout_s)

  def dial(self, index: int, *, recv_timeout_s: float | None,
           send_timeout_s: float | None) -> mpc.Connection:
    """An authenticated connection to worker `index` (`dial`)."""
    return dial(self.address(index), self.authkey, recv_timeout_s=recv_timeout_s,
                send_timeout_s=send_timeout_s)

  @staticmethod
  def shutdown(conn: mpc.Connection) -> None:
    shutdown(conn)

  @staticmethod
  def describe(e: BaseException) -> str:
    return describe(e)


def set_timeouts(conn: mpc.Connection, recv_s: float | None, send_s: float | None) -> None:
  """Kernel timeouts for `conn`'s reads and writes (None: wait for ever)."""
  _set_timeouts(conn.fileno(), recv_s, send_s)


def shutdown(conn: mpc.Connection) -> None:
  """Ends `conn` both ways, waking a thread blocked reading it (closing the
  descriptor would not), without closing it under that thread."""
  try:
    sock = socket.socket(fileno=conn.fileno())
  except OSError:  # closed already
    return
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  finally:
    sock.detach()


def dial(address: str, authkey: bytes, *, recv_timeout_s: float | None,
         send_timeout_s: float | None) -> mpc.Connection:
  """An authenticated connection to the worker listening at `address`, its
  reads and writes then bounded by the given timeouts. Connect and each
  read or write of the handshake wait at most HEAD_HANDSHAKE_TIMEOUT_S,
  then raise OSError (EOFError, mpc.AuthenticationError, or anything a
  garbled challenge raises, for a peer that answers wrongly)."""
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    _set_timeouts(sock.fileno(), HEAD_HANDSHAKE_TIMEOUT_S, HEAD_HANDSHAKE_TIMEOUT_S)
    sock.connect(address)  # waits for room in the backlog, as long as a send may
  except BaseException:
    sock.close()
    raise
  conn = _handshake(sock, lambda c: (mpc.answer_challenge(c, authkey),
                                     mpc.deliver_challenge(c, authkey)))
  set_timeouts(conn, recv_timeout_s, send_timeout_s)
  return conn


class Listener:
  """Accepts connections at `address` (a stale socket file of this index's
  earlier life is replaced) and hands each authenticated one to
  `serve(conn)`, on the thread that authenticated it, after setting its
  send timeout to `send_timeout_s` (reads wait for ever: a peer may send
  nothing for hours). Thread-safe."""

  def __init__(self, address: str, authkey: bytes,
               serve: Callable[[mpc.Connection], None], *, send_timeout_s: float | None):
    self._address = address
    self._authkey = authkey
    self._serve = serve
    self._send_timeout_s = send_timeout_s
    self._handshakes = threading.BoundedSemaphore(MAX_HEAD_HANDSHAKES)
    self._throttled = Throttled(HEAD_LOG_PERIOD_S, log)
    self._closed = False
    if os.path.exists(address):
      os.unlink(address)
    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      self._sock.bind(address)
      self._sock.listen(_BACKLOG)
    except BaseException:
      self._sock.close()
      raise
    threading.Thread(target=self._accept, name="elevator-head-accept", daemon=True).start()

  def close(self) -> None:
    self._closed = True
    try:
      self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept (EINVAL)
    except OSError:
      pass
    self._sock.close()
    try:
      os.unlink(self._address)
    except OSError:
      pass

  def _accept(self) -> None:
    while not self._closed:
      try:
        sock, _ = self._sock.accept()
      except OSError as e:
        if self._closed:
          return
        self._throttled.warning("accept", "head socket %s: accept failed (%s); trying again",
                                self._address, e)
        time.sleep(_ACCEPT_BACKOFF_S)
        continue
      if not self._handshakes.acquire(blocking=False):
        sock.close()
        self._throttled.warning(
            "busy", "head socket %s: a connection closed unauthenticated, %d others being "
            "authenticated already (MAX_HEAD_HANDSHAKES)", self._address, MAX_HEAD_HANDSHAKES)
        continue
      try:
        threading.Thread(target=self._greet, args=(sock,), name="elevator-head-answer",
                         daemon=True).start()
      except RuntimeError as e:  # can't start a new thread
        self._handshakes.release()
        sock.close()
        self._throttled.warning("thread", "head socket %s: a connection closed: %s",
                                self._address, e)

  def _greet(self, sock: socket.socket) -> None:
    """Authenticates one connection, then serves it on this thread."""
    try:
      conn = _handshake(sock, lambda c: (mpc.deliver_challenge(c, self._authkey),
                                         mpc.answer_challenge(c, self._authkey)))
    except Exception as e:  # pylint: disable=broad-except
      self._throttled.warning(
          "handshake", "head socket %s: a connection that did not complete its handshake "
          "was closed (%s)", self._address, describe(e))
      return
    finally:
      self._handshakes.release()
    try:
      set_timeouts(conn, None, self._send_timeout_s)
    except OSError:
      conn.close()
      return
    self._serve(conn)


def describe(e: BaseException) -> str:
  """What a failed handshake or read means, in words."""
  if isinstance(e, BlockingIOError):
    return "the peer went silent past its timeout"
  if isinstance(e, (EOFError, BrokenPipeError, ConnectionResetError)):
    return "the peer closed the connection"
  if isinstance(e, mpc.AuthenticationError):
    return f"authentication failed: {e}"
  return f"{type(e).__name__}: {e}"


def _handshake(sock: socket.socket,
               steps: Callable[[mpc.Connection], object]) -> mpc.Connection:
  """`sock` as a multiprocessing connection that has run `steps` (the
  challenges), each read and write bounded by HEAD_HANDSHAKE_TIMEOUT_S; closed
  if they raise."""
  try:
    _set_timeouts(sock.fileno(), HEAD_HANDSHAKE_TIMEOUT_S, HEAD_HANDSHAKE_TIMEOUT_S)
  except OSError:
    sock.close()
    raise
  conn = mpc.Connection(sock.detach())
  try:
    steps(conn)
  except BaseException:
    conn.close()
    raise
  return conn


def _set_timeouts(fd: int, recv_s: float | None, send_s: float | None) -> None:
  sock = socket.socket(fileno=fd)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))
  finally:
    sock.detach()


def _timeval(seconds: float | None) -> bytes:
  """A struct timeval; all zero means no timeout, so a timeout is at least 1 µs."""
  if seconds is None:
    return struct.pack("ll", 0, 0)
  micros = max(1, round(seconds * 1e6))
  return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
