"""Admission: how many requests one worker serves at once, and who must yield.

Every request (Describe, GetBatches; gRPC or bulk) holds a ticket while it
runs; beyond `limit` tickets a request is refused RESOURCE_EXHAUSTED and the
client backs off or moves to another replica. Health checks hold none.

A request spends its time in two states: producing (reading records,
running the pipeline) or waiting for its client to take the batch it has
sent. A client that never reads would hold its ticket forever, so:

  * write timeout: a request that has waited `write_timeout_s` for its
    client is cancelled (a watchdog checks once a second);
  * long streams yield: when every ticket is taken, a newcomer cancels
    the request that has waited longest for its client, if that wait is over
    STALL_GRACE_S, or else the stream that has held its slot longest, if it
    has sent a batch and run over SLICE_S; and takes its place. A trainer's
    requests are a step or a few (`steps_per_request`), far shorter; a
    stream cut this way ends CANCELLED and its client resumes from the step
    it reached. So slots go round, and a client that asks for an endless
    stream and never reads (its flow-control window fills before it stalls,
    which can take many seconds) holds one only for its slice.

Long streams (over LONG_STREAM_STEPS steps; a trainer asks for a step or
a few at a time) may hold at most half the slots, so the other half is
always there for short requests, whatever a client holding endless streams
does.

Cancelling is the transport's: gRPC cancels the call, the bulk transport
shuts the socket down; either way the request's thread wakes from its send
and ends. A cancelled ticket stops counting at once: its thread is only
unwinding, doing no work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

from grain_elevator.proto.errors import ResourceExhaustedError, ServiceUnavailableError
from grain_elevator.proto.limits import LONG_STREAM_STEPS
from grain_elevator.server.serving import metrics

log = logging.getLogger("grain_elevator.server")

# A request that has waited this long for its client to read may be cancelled
# to admit another when every slot is taken. Longer than a reading client
# takes to drain one batch from its socket buffer (a 256 MiB message at
# 1 GB/s is 0.25 s).
STALL_GRACE_S = 1.0
SLICE_S = 2.0
_WATCHDOG_PERIOD_S = 1.0
# Under attack cancellations come by the hundred: one log line per period,
# with the count of those it stands for.
_LOG_PERIOD_S = 10.0


class Ticket:
  """One admitted request; the transport marks when it waits for its client."""

  __slots__ = ("_admission", "_cancel", "long", "started", "sent", "waiting_since",
               "cancelled", "released", "request")

  def __init__(self, admission: "Admission", cancel: Callable[[], None] | None, long: bool):
    self._admission = admission
    self._cancel = cancel
    self.long = long
    self.started = time.monotonic()
    self.sent = 0
    self.waiting_since: float | None = None
    self.cancelled = False
    self.released = False
    self.request: Any = None  # the transport's, for its own use

  @contextlib.contextmanager
  def waiting(self) -> Iterator[None]:
    """Around the send of one batch, which blocks until the client reads."""
    self.waiting_since = time.monotonic()
    try:
      yield
    finally:
      self.waiting_since = None
      self.sent += 1

  def cancel(self, why: str) -> None:
    """Ends the request (the transport's cancel) and frees its slot."""
    if self._cancel is None:
      return
    self._admission._log_cancel(why)
    self.cancelled = True
    self._admission._forget(self)
    try:
      self._cancel()
    except Exception:  # pylint: disable=broad-except
      log.exception("cancelling a request failed")

  def release(self) -> None:
    self._admission._forget(self)


class Admission:
  """The tickets of one worker; refuses beyond `limit` or once closed."""

  def __init__(self, limit: int | None, *, write_timeout_s: float | None = None):
    self._limit = limit
    self._write_timeout_s = write_timeout_s
    self._lock = threading.Condition()
    self._tickets: set[Ticket] = set()
    self._closed = False
    self._watchdog: threading.Thread | None = None
    self._logged_at = -_LOG_PERIOD_S
    self._unlogged = 0
    # Called with the number of requests in flight each time a request is
    # admitted or ends, in order (under the lock, so keep it cheap): the
    # worker tells the supervisor it is busy until its last request ends
    # (`--idle-exit-s`). Health checks are not admitted: probes do not count.
    self.on_in_flight: Callable[[int], None] | None = None

  @property
  def in_flight(self) -> int:
    with self._lock:
      return len(self._tickets)

  def acquire(self, cancel: Callable[[], None] | None = None, *, steps: int = 1) -> Ticket:
    """A ticket, or ResourceExhaustedError / ServiceUnavailableError.
    `cancel` ends the request from another thread; without one the request
    is never cancelled (it cannot be stalled by a client: Describe).
    `steps`: how many the request asks for."""
    victim = None
    long = steps > LONG_STREAM_STEPS
    with self._lock:
      if self._closed:
        raise ServiceUnavailableError("server is shutting down")
      if self._limit is not None and long:
        long_limit = max(1, self._limit // 2)
        if sum(t.long for t in self._tickets) >= long_limit:
          victim, why = self._victim(only_long=True)
          if victim is None:
            raise ResourceExhaustedError(
                f"streams of over {LONG_STREAM_STEPS} steps may hold {long_limit} of this "
                f"worker's {self._limit} request slots, and they do")
      if victim is None and self._limit is not None and len(self._tickets) >= self._limit:
        victim, why = self._victim()
        if victim is None:
          raise ResourceExhaustedError(
              f"worker is serving its maximum of {self._limit} concurrent requests")
      if victim is not None:
        self._tickets.discard(victim)
      ticket = Ticket(self, cancel, long)
      self._tickets.add(ticket)
      metrics.current().inflight(1)
      self._tell_in_flight()
      self._start_watchdog()
    if victim is not None:
      victim.cancel(f"every slot is taken and {why}: it yields to a newcomer")
    return ticket

  @contextlib.contextmanager
  def __call__(self, cancel: Callable[[], None] | None = None, *,
               steps: int = 1) -> Iterator[Ticket]:
    ticket = self.acquire(cancel, steps=steps)
    try:
      yield ticket
    finally:
      ticket.release()

  def _log_cancel(self, why: str) -> None:
    with self._lock:
      now = time.monotonic()
      if now - self._logged_at < _LOG_PERIOD_S:
        self._unlogged += 1
        return
      more, self._unlogged, self._logged_at = self._unlogged, 0, now
    log.warning("cancelling a request: %s%s", why,
                f" ({more} more cancelled since the last such line)" if more else "")

  def _forget(self, ticket: Ticket) -> None:
    with self._lock:
      self._tickets.discard(ticket)
      if not ticket.released:
        metrics.current().inflight(-1)
        self._tell_in_flight()
      ticket.released = True
      self._lock.notify_all()

  def _tell_in_flight(self) -> None:
    """Calls `on_in_flight` (hold the lock)."""
    if self.on_in_flight is not None:
      self.on_in_flight(len(self._tickets))

  def _victim(self, only_long: bool = False) -> tuple[Ticket | None, str]:
    """The request to cancel for a newcomer, and why; (None, "") if none may be."""
    now = time.monotonic()
    cancellable = [t for t in self._tickets
                   if t._cancel is not None and (t.long or not only_long)]
    stalled = [t for t in cancellable
               if t.waiting_since is not None and now - t.waiting_since >= STALL_GRACE_S]
    if stalled:
      t = min(stalled, key=lambda t: t.waiting_since or 0.0)
      return t, f"its client has not read for {now - (t.waiting_since or now):.1f}s"
    long = [t for t in cancellable if t.sent and now - t.started >= SLICE_S]
    if long:
      t = min(long, key=lambda t: t.started)
      return t, f"its stream has held a slot for {now - t.started:.1f}s ({t.sent} batches)"
    return None, ""

  def _start_watchdog(self) -> None:
    if self._write_timeout_s is None or self._watchdog is not None:
      return
    self._watchdog = threading.Thread(target=self._watch, name="elevator-write-timeout",
                                      daemon=True)
    self._watchdog.start()

  def _watch(self) -> None:
    """Cancels requests whose client has not read for `write_timeout_s`."""
    assert self._write_timeout_s is not None
    while True:
      time.sleep(_WATCHDOG_PERIOD_S)
      with self._lock:
        now = time.monotonic()
        late = [t for t in self._tickets
                if t._cancel is not None and t.waiting_since is not None
                and now - t.waiting_since >= self._write_timeout_s]
        for t in late:
          self._tickets.discard(t)
      for t in late:
        t.cancel(f"its client has not read for {self._write_timeout_s:g}s "
                 "(--write-timeout-s)")

  def close(self) -> None:
    """Refuses every later request (UNAVAILABLE); those in flight go on."""
    with self._lock:
      self._closed = True

  def wait_idle(self, timeout_s: float) -> bool:
    """Waits until no request is in flight; False if `timeout_s` passed first."""
    with self._lock:
      return self._lock.wait_for(lambda: not self._tickets, timeout_s)
