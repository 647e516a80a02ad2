"""Where the client retries: which failures are tried again, the backoff,
and when the trainer is told.

Every request the pool makes (Describe, a chunk of steps) runs as attempts
of `Retrier.run`. A failure in RETRIABLE shuns the replica that failed
(slots.py) and sends what is left of the request (the steps not yet
received) to the next connection after a capped, jittered exponential
backoff, both from `RetryPolicy`; steps already received are kept, so each
step reaches the trainer exactly once, in order, whichever replica served
it. The trainer gets `ServiceUnavailableError` only when `timeout_s` passes
without a step arriving. RESOURCE_EXHAUSTED says the replica is full right
now: where the next attempt goes is the pool's choice (another replica, the
other transport, or the same after the backoff), said in one rate-limited
warning. A replica that sends a batch breaking the element spec is shunned
too, and the trainer gets `DataLossError` only once every replica has.
Statuses in REFUSED (a wrong token) are never retried: every replica and
transport would refuse the same.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Collection, Generic, TypeVar

import grpc

from grain_elevator.client.transport.options import RetryPolicy
from grain_elevator.client.transport.connection import BadReplyError, TransportError
from grain_elevator.client.transport.targets import replica_name
from grain_elevator.proto import errors
from grain_elevator.proto.throttle import Throttled

log = logging.getLogger("grain_elevator.client")
T = TypeVar("T")
S = TypeVar("S")

# Statuses after which a request is sent again (for its remaining steps) to
# another connection or replica. CANCELLED here is a server's (one shutting
# down); the client's own cancellations never reach the retry loop.
RETRIABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
})
# Statuses a replica refuses this client with whatever it asks (its token,
# its rights): another replica or transport would refuse it too, so the
# trainer gets the typed error at once.
REFUSED = frozenset({
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
})
# A full (or lying) replica fails requests by the hundred: one warning per period.
_LOG_PERIOD_S = 10.0

Replica = tuple[str, str]  # (target, address)


class Retrier(Generic[S]):
  """Runs a request's attempts, each given where to go (`S`: the pool's
  slots), until one returns or the policy gives up."""

  def __init__(self, policy: RetryPolicy, targets: list[str], closed: Callable[[], bool]):
    self.policy = policy
    self._targets = targets
    self._closed = closed
    self._full_log = Throttled(_LOG_PERIOD_S, log)
    self._lie_log = Throttled(_LOG_PERIOD_S, log)
    self.retries = 0  # attempts tried again (client/stats.py)

  def run(self, what: Callable[[], str], attempt: Callable[[S | None], T], slots: S | None,
          *, cancelled: Callable[[], bool] = lambda: False,
          progress: Callable[[], int] = lambda: 0, timeout_s: float | None = None,
          retriable: frozenset[grpc.StatusCode] = RETRIABLE,
          after_full: Callable[[TransportError, S | None], tuple[S | None, str]] | None = None
          ) -> T:
    """`attempt(slots)` until it returns, with backoff. A retriable
    TransportError (or a BadReplyError, where `slots` hold other replicas
    that may answer right) is tried again until `timeout_s` (the policy's
    by default) passes without `progress()` growing; any other one raises
    its typed error. After RESOURCE_EXHAUSTED, `after_full(error, slots)`
    says where the next attempt goes, and why (for the warning)."""
    timeout_s = timeout_s or self.policy.timeout_s
    deadline = time.monotonic() + timeout_s
    last: TransportError | None = None
    tries = 0
    use = slots
    while True:
      before = progress()
      try:
        return attempt(use)
      except TransportError as e:
        if cancelled() or self._closed():
          raise errors.Cancelled(f"{what()}: cancelled") from e
        if e.code not in retriable and not (isinstance(e, BadReplyError) and slots):
          raise e.to_error() from e
        last = e
        if progress() > before:  # steps arrived: a fresh window
          deadline = time.monotonic() + timeout_s
          tries = 0
        use = slots
        self.retries += 1
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
          use, move = after_full(e, slots) if after_full else (slots, "asking again")
          replica = replica_name(e.replica)
          self._full_log.warning((replica, move), "%s is full (RESOURCE_EXHAUSTED: %s); %s (%s)",
                                 replica, e.details, move, what())
      if time.monotonic() >= deadline:
        raise errors.ServiceUnavailableError(
            f"no replica of {', '.join(self._targets)} could serve {what()} within "
            f"{timeout_s:.0f}s (last error: {last.code.name}: {last.details})")
      cap = self.policy.backoff_cap(tries)
      time.sleep(random.uniform(cap / 2, cap))
      tries += 1
      if cancelled():
        raise errors.Cancelled(f"{what()}: cancelled")

  def lied(self, e: BadReplyError, liars: set[Replica], replicas: Collection[Replica]) -> None:
    """Notes that the replica behind `e` sent a bad reply to this request
    (a batch, or a Describe; the slot has shunned it); DataLossError once
    every one of `replicas` has."""
    liars.add(e.replica)
    if set(replicas) <= liars:
      raise errors.DataLossError(
          f"{e.details} (every replica of {', '.join(self._targets)} sent a reply that "
          "breaks the element spec, its size bound or the protocol)") from e
    replica = replica_name(e.replica)
    self._lie_log.warning(replica, "%s; shunning %s and asking another replica",
                          e.details, replica)
