"""A worker's read-ahead: the byte ranges the next steps need, fetched
before anyone asks, held until those steps are made.

The planner (server/serving/read_plan.py) hands `plan` the steps it expects
to make, in the order it expects them: each a *group*, a tag and the chunk
extents it needs per object. Extents no entry holds yet are coalesced over
all the groups planned together (ranges.py: neighbours within
COALESCE_GAP_BYTES, at most MAX_RANGE_BYTES a range, as a batch's own reads
are) and requested at once, concurrently (storage/objects.py, MAX_IN_FLIGHT
per worker); each range is an *entry*, which counts the groups that need
it. A read takes the chunks it needs (`take`): those an entry holds come
from it (waiting for it if it is still on its way), the rest it fetches
itself. When a group's step has been made, `release` lets go of it, and an
entry no group needs any more is dropped.

Bounded: the entries' bytes stay within the budget (`budget_bytes`,
`--read-ahead-mb`); a plan stops at the first group that would pass it
(that group and those after it are read when asked for, as without a plan).
A group that is never released (the client went to another worker, or gave
up) is dropped `stale_s` (STALE_S) after it was planned, and its entries
with it. The bytes are those of the object's recorded version (every fetch
is pinned), so a planned read gives exactly what an unplanned one would: a
fetch that failed is not used, and the read fetches those chunks again
itself, meeting the error (a replaced object, storage down) in its own step.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import threading
import time
from typing import Hashable, Sequence

from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage.objects import ObjectRef
from grain_elevator.server.data.storage.ranges import coalesce

# A worker's default read-ahead budget (--read-ahead-mb): the next few
# requests of most datasets (a request of the image bench's steps is ~15 MB
# of JPEGs).
DEFAULT_READ_AHEAD_MB = 256
DEFAULT_READ_AHEAD_BYTES = DEFAULT_READ_AHEAD_MB << 20
# A group planned this long ago and not released is dropped, with the
# entries no other group needs: a read that comes later fetches for itself.
STALE_S = 30.0
# Groups remembered as planned at most (each a small tuple).
MAX_GROUPS = 1 << 16

# What a group needs: per object, the extents [begin, end) of its chunks.
Needs = Sequence[tuple[ObjectRef, Sequence[tuple[int, int]]]]


class Counts:
  """What the read-ahead reports (the server's metrics implement it): bytes
  fetched (planned or not) and bytes reads needed, per dataset, and the
  bytes its entries hold. Here: nothing."""

  def storage_bytes(self, dataset: str, *, fetched: int = 0, needed: int = 0,
                    planned: bool = False) -> None:
    pass

  def read_ahead_bytes(self, nbytes: int) -> None:
    pass


@dataclasses.dataclass(eq=False)
class _Entry:
  obj: ObjectRef  # the object as recorded: another version is another key
  begin: int
  end: int
  future: concurrent.futures.Future
  uses: int = 0  # groups that need it and have not been released

  @property
  def size(self) -> int:
    return self.end - self.begin


def _coalesced_bytes(extents: set[tuple[int, int]]) -> int:
  return sum(b - a for a, b in coalesce(sorted(extents)))


class ReadAhead:
  """One process's planned ranges (thread-safe: guarded by `_lock`)."""

  def __init__(self, budget_bytes: int = DEFAULT_READ_AHEAD_BYTES, counts: Counts | None = None,
               *, stale_s: float = STALE_S):
    self.budget_bytes = budget_bytes
    self.counts = counts or Counts()
    self.stale_s = stale_s
    self._lock = threading.Lock()
    # Per object (as recorded, so never another version's bytes): its entries'
    # begins, sorted, and its entries by begin.
    self._starts: dict[ObjectRef, list[int]] = {}
    self._entries: dict[ObjectRef, dict[int, _Entry]] = {}
    # Groups planned and not released -> (when, their entries), oldest first.
    self._groups: dict[Hashable, tuple[float, list[_Entry]]] = {}
    self._bytes = 0

  @property
  def bytes(self) -> int:
    """The bytes the entries hold (or will, once fetched)."""
    with self._lock:
      return self._bytes

  @property
  def in_flight(self) -> int:
    """The planned ranges still on their way from storage."""
    with self._lock:
      return sum(not e.future.done() for held in self._entries.values() for e in held.values())

  @property
  def holds_groups(self) -> bool:
    """Whether any group is planned (read without the lock: a hint that
    lets steps of local datasets skip `release`)."""
    return bool(self._groups)

  def planned(self, tag: Hashable) -> bool:
    with self._lock:
      return tag in self._groups

  # -- planning ----------------------------------------------------------------

  def plan(self, dataset: str, groups: Sequence[tuple[Hashable, Needs]]) -> int:
    """Requests what `groups` need and no entry holds, within the budget;
    groups planned before are skipped. Returns how many were planned now
    (it stops at the first that does not fit)."""
    if self.budget_bytes <= 0:
      return 0
    now = time.monotonic()
    with self._lock:
      self._sweep(now)
      new: dict[ObjectRef, set[tuple[int, int]]] = {}  # extents to fetch, per object
      new_bytes: dict[ObjectRef, int] = {}  # their coalesced bytes, per object
      first: dict[tuple[ObjectRef, int, int], int] = {}  # extent -> first group needing it
      accepted: list[tuple[Hashable, Needs]] = []
      for tag, needs in groups:
        if tag in self._groups or len(self._groups) + len(accepted) >= MAX_GROUPS:
          continue
        adds = {obj: [e for e in extents if self._find(obj, *e) is None
                      and e not in new.get(obj, ())] for obj, extents in needs}
        sizes = {obj: _coalesced_bytes(new.get(obj, set()) | set(extents))
                 for obj, extents in adds.items() if extents}
        total = sum({**new_bytes, **sizes}.values())
        if self._bytes + total > self.budget_bytes:
          break
        for obj, extents in adds.items():
          new.setdefault(obj, set()).update(extents)
          for e in extents:
            first.setdefault((obj, *e), len(accepted))
        new_bytes.update(sizes)
        accepted.append((tag, needs))
      fetches: list[tuple[int, _Entry]] = []  # (the first group that needs it, entry)
      for obj, extents in new.items():
        ordered = sorted(extents)
        i = 0
        for begin, end in coalesce(ordered):
          entry = _Entry(obj, begin, end, concurrent.futures.Future())
          group = len(accepted)
          while i < len(ordered) and ordered[i][1] <= end:
            group = min(group, first[(obj, *ordered[i])])
            i += 1
          if self._add(entry):
            fetches.append((group, entry))
      # Requested in the order of the groups that need them, the first first:
      # the first step's ranges are not queued behind the later steps'.
      fetches.sort(key=lambda f: f[0])
      for tag, needs in accepted:
        entries = {id(e): e for obj, extents in needs for e in
                   (self._find(obj, *x) for x in extents) if e is not None}
        for entry in entries.values():
          entry.uses += 1
        self._groups[tag] = (now, list(entries.values()))
      held_bytes = self._bytes
    objects_lib.objects().fetch_later([(e.obj, e.begin, e.end) for _, e in fetches],
                                      [e.future for _, e in fetches])
    if fetches:
      self.counts.storage_bytes(dataset, fetched=sum(e.size for _, e in fetches), planned=True)
    self.counts.read_ahead_bytes(held_bytes)
    return len(accepted)

  def release(self, tag: Hashable) -> None:
    """Group `tag`'s step is made (or will not be): its entries are let go
    of, and dropped where no other group needs them."""
    with self._lock:
      got = self._groups.pop(tag, None)
      if got is None:
        return
      self._unuse(got[1])
      held_bytes = self._bytes
    self.counts.read_ahead_bytes(held_bytes)

  # -- reading -------------------------------------------------------------------

  def take(self, obj: ObjectRef, extents: Sequence[tuple[int, int]]
           ) -> tuple[dict[int, memoryview], list[tuple[int, int]]]:
    """The chunks of `obj` at `extents` that entries hold, by begin (waiting
    for entries still on their way), and the extents they do not hold (or
    whose fetch failed): those the caller fetches itself."""
    with self._lock:
      where = [(begin, end, self._find(obj, begin, end)) for begin, end in extents]
    views: dict[int, memoryview] = {}
    missing: list[tuple[int, int]] = []
    for begin, end, entry in where:
      data = None
      if entry is not None:
        try:
          data = entry.future.result()
        except Exception:  # pylint: disable=broad-except
          data = None  # the read fetches it itself, and meets the error in its own step
      if data is None:
        missing.append((begin, end))
      else:
        views[begin] = memoryview(data)[begin - entry.begin:end - entry.begin]
    return views, missing

  # -- bookkeeping (under _lock) ----------------------------------------------------

  def _find(self, obj: ObjectRef, begin: int, end: int) -> _Entry | None:
    starts = self._starts.get(obj)
    if not starts:
      return None
    i = bisect.bisect_right(starts, begin) - 1
    entries = self._entries[obj]
    for j in range(i, max(-1, i - 4), -1):  # entries may overlap a little
      entry = entries[starts[j]]
      if entry.begin <= begin and end <= entry.end:
        return entry
    return None

  def _add(self, entry: _Entry) -> bool:
    """Indexes `entry`; False where one that starts there already is
    (what it would hold is then fetched by the reads themselves)."""
    entries = self._entries.setdefault(entry.obj, {})
    if entry.begin in entries:
      return False
    bisect.insort(self._starts.setdefault(entry.obj, []), entry.begin)
    entries[entry.begin] = entry
    self._bytes += entry.size
    return True

  def _remove(self, entry: _Entry) -> None:
    entries = self._entries.get(entry.obj)
    if entries is None or entries.get(entry.begin) is not entry:
      return
    del entries[entry.begin]
    starts = self._starts[entry.obj]
    del starts[bisect.bisect_left(starts, entry.begin)]
    if not entries:
      del self._entries[entry.obj], self._starts[entry.obj]
    self._bytes -= entry.size

  def _unuse(self, entries: list[_Entry]) -> None:
    for entry in entries:
      entry.uses -= 1
      if entry.uses <= 0:
        self._remove(entry)

  def _sweep(self, now: float) -> None:
    """Drops the groups planned over `stale_s` ago, and entries no other
    group needs."""
    old = now - self.stale_s
    while self._groups:
      tag, (at, entries) = next(iter(self._groups.items()))
      if at >= old:
        break
      del self._groups[tag]
      self._unuse(entries)


_current: ReadAhead | None = None
_current_lock = threading.Lock()


def current() -> ReadAhead:
  """This process's read-ahead (a worker configures its budget at start)."""
  global _current
  with _current_lock:
    if _current is None:
      _current = ReadAhead()
    return _current


def configure(budget_bytes: int, counts: Counts | None = None, *,
              stale_s: float = STALE_S) -> ReadAhead:
  """Sets this process's read-ahead budget (and where it reports); 0: off."""
  global _current
  with _current_lock:
    _current = ReadAhead(budget_bytes, counts, stale_s=stale_s)
    return _current
