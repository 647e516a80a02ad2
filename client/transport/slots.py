"""A connection's place in the pool, and which worker owns a chunk of steps.

A replica's worker processes share one port and the kernel hands each new
TCP connection to one of them by a hash, so a handful of connections can
easily all land on one worker: `spread_over_workers` opens connections until
each worker holds an equal share (the bulk handshake, or Describe over gRPC,
says which worker answered and how many the replica has; a default client
wants options.py's REQUESTS_PER_WORKER on each) and closes the
surplus. `Slots` lends them to
fetch threads, one request at a time over a bulk connection, shunning a
replica that failed (RetryPolicy's shun times); `owner_of` sends chunk c of
a stream to the same worker from every trainer, whose batch cache then
serves it to all, dealing chunks over replicas in proportion to their
workers.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from grain_elevator.client.transport.options import RetryPolicy
from grain_elevator.client.transport.connection import Connection


@dataclasses.dataclass(eq=False)
class Slot:
  """A connection's place in the pool: reopened after it broke, shunned
  (with the rest of its replica) after failures, retired once its address
  left DNS."""

  conn: Connection
  in_use: int = 0
  failures: int = 0
  shunned_until: float = 0.0
  served: int = 0  # steps received over it (and the connections it replaced)
  retired: bool = False  # closed and dropped when its request ends

  @property
  def replica(self) -> tuple[str, str]:
    return self.conn.target, self.conn.host


class Slots:
  """Connections shared by fetch threads: each request checks one out (a
  bulk connection carries one request at a time, so they also bound the
  requests in flight) and returns it saying whether it failed."""

  def __init__(self, slots: list[Slot], retry: RetryPolicy):
    self._slots = slots
    self._retry = retry
    self._free = threading.Condition()
    self._next = itertools.count()
    self._closed = False
    # owners_by_turn of the live slots, and the connections it was derived from (`_owner`)
    self._turns: list[list[Slot]] = []
    self._turns_of: tuple[Connection, ...] = ()

  def __bool__(self) -> bool:
    return bool(self._slots)

  def __iter__(self):
    return iter(list(self._slots))

  def checkout(self, cancelled: Callable[[], bool], route: int | None = None) -> Slot | None:
    """A slot with room (None once cancelled or closed), preferring replicas
    not failing lately: waits for a healthy one rather than take a failing
    one, unless all fail. `route` (a chunk number): a slot of the worker
    that owns it (`owner_of`), waiting for one of its slots to be free,
    unless that worker has none or its replica is failing; else round-robin."""
    with self._free:
      while True:
        if cancelled() or self._closed:
          return None
        now = time.monotonic()
        live = [s for s in self._slots if not s.retired]
        owners = self._owner(live, route) if route is not None else []
        if owners and all(s.shunned_until <= now for s in owners):
          free = [s for s in owners if s.in_use < s.conn.capacity]
        else:
          healthy = [s for s in live if s.shunned_until <= now]
          free = [s for s in (healthy or live) if s.in_use < s.conn.capacity]
        if free:
          chosen = free[next(self._next) % len(free)]
          chosen.in_use += 1
          return chosen
        self._free.wait(0.1)

  def _owner(self, live: list[Slot], route: int) -> list[Slot]:
    """`owner_of(live, route)`, the turns derived once per set of live
    connections (a reconnect replaces a slot's connection, which may reach
    another worker): checkout asks per request, and at each wake-up."""
    conns = tuple([s.conn for s in live])  # held, so no new one can take an old one's id
    if conns != self._turns_of:
      self._turns, self._turns_of = owners_by_turn(live), conns
    return self._turns[route % len(self._turns)] if self._turns else []

  def release(self, slot: Slot, *, failed: bool, lied: bool = False) -> None:
    """Returns `slot`. A failure shuns its whole replica (RetryPolicy.shun_s):
    its other connections would most likely each cost a timeout to find the
    same. A replica that `lied` (sent a batch breaking the spec) is shunned
    for shun_max_s: its next answer is unlikely to be better."""
    with self._free:
      if failed or lied:
        slot.failures += 1
        until = time.monotonic() + (self._retry.shun_max_s if lied
                                    else self._retry.shun_s(slot.failures))
        for other in self._slots:
          if other.replica == slot.replica:
            other.shunned_until = max(other.shunned_until, until)
      else:
        slot.failures = 0
      slot.in_use -= 1
      if slot.retired:
        self._drop_retired()
      # Every waiter: one may wait for this worker's slot (a routed chunk),
      # and a notify() could wake another, leaving it to its 0.1 s timeout.
      self._free.notify_all()

  def has_room_elsewhere(self, replica: tuple[str, str] | None) -> bool:
    """Whether a replica other than `replica` is not shunned (its slots may
    be busy: checkout waits for them)."""
    now = time.monotonic()
    with self._free:
      return any(s.replica != replica and not s.retired and s.shunned_until <= now
                 for s in self._slots)

  def add(self, slots: list[Slot]) -> None:
    with self._free:
      if self._closed:
        for slot in slots:
          slot.conn.close()
        return
      self._slots.extend(slots)
      self._free.notify_all()

  def retire(self, which: Callable[[Slot], bool]) -> None:
    """Takes the slots `which` picks out of service: closed now if idle,
    else once their request ends."""
    with self._free:
      for slot in self._slots:
        if which(slot):
          slot.retired = True
      self._drop_retired()

  def _drop_retired(self) -> None:
    done = [s for s in self._slots if s.retired and not s.in_use]
    for slot in done:
      slot.conn.close()
    self._slots = [s for s in self._slots if s not in done]

  def close(self) -> None:
    with self._free:
      self._closed = True
      for slot in self._slots:
        slot.conn.close()
      self._free.notify_all()


def owner_of(slots: Sequence[Slot], chunk: int) -> list[Slot]:
  """The slots to the worker that owns `chunk`, a function of the chunk and
  the replicas alone, so every trainer sends the same chunk to the same
  worker, whose cache then serves it to all (server/serving/batch_cache.py).
  The workers of every replica (sorted by address) are taken worker index
  first, chunk c going to the (c mod total)th: consecutive chunks spread
  over all, each replica getting its share of the workers (replicas of
  equal size: replica c mod R, there worker (c // R) mod W)."""
  turns = owners_by_turn(slots)
  return turns[chunk % len(turns)] if turns else []


def owners_by_turn(slots: Sequence[Slot]) -> list[list[Slot]]:
  """`owner_of` for every chunk at once: item t holds the slots of the
  worker owning chunks c with c mod len == t (none: no slot knows its worker)."""
  workers: dict[tuple[str, str], int] = {}
  for s in slots:
    if getattr(s.conn, "server", None):
      workers[s.replica] = max(workers.get(s.replica, 0), s.conn.server.num_workers)
  replicas = sorted(workers)
  pairs = [(r, w) for w in range(max(workers.values(), default=0))
           for r in replicas if w < workers[r]]
  return [[s for s in slots if s.replica == replica and getattr(s.conn, "server", None)
           and s.conn.server.worker_index == worker] for replica, worker in pairs]


def spread_over_workers(open_one: Callable[[], Any | None], per_target: int | None,
                        per_worker: int = 1) -> list[list[Any]]:
  """Connections to one replica, grouped by the worker process that took each.

  Opens connections (each knows its worker, `conn.server`, and how many the
  replica has) until every worker holds ceil(per_target / workers), or
  `per_worker` where `per_target` is None, closing the surplus. Stops early
  when `open_one` fails (returns None).
  """
  by_worker: dict[int, list[Any]] = collections.defaultdict(list)
  attempts, most = 0, 8 * max(per_target or 0, 4)
  while attempts < most:
    attempts += 1
    conn = open_one()
    if conn is None:
      break
    workers = max(1, conn.server.num_workers)
    want = per_worker if per_target is None else -(-per_target // workers)  # at least 1
    most = max(most, 8 * want * workers)  # the kernel deals connections by a hash
    group = by_worker[conn.server.worker_index]
    if len(group) < want:
      group.append(conn)
    else:
      conn.close()
    if len(by_worker) >= workers and all(len(g) >= want for g in by_worker.values()):
      break
  return list(by_worker.values())


def interleave(groups: list[list[Any]]) -> list[Any]:
  """Workers' and replicas' connections taken in turn, so consecutive
  requests spread out."""
  return [c for layer in itertools.zip_longest(*groups) for c in layer if c]
