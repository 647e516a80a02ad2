"""A worker's read-ahead: the byte ranges the next steps need, fetched
before anyone asks, held until those steps are made.

The planner (server/serving/read_plan.py) hands `plan` the steps it expects
to make, in the order it expects them: each a *group*, a tag and the chunk
extents it needs per object. Extents no entry holds yet are coalesced over
all the groups planned together (ranges.py: neighbours within
COALESCE_GAP_BYTES, at most MAX_RANGE_BYTES a range, as a batch's own reads
are) and requested at once, concurrently (storage/objects.py, MAX_IN_FLIGHT
per worker); each range is an *entry*, which counts the groups that need
it. Planning is linear in the extents, and holds the lock for a piece of
ROWS_PER_HOLD extents at a time: another request's plan or read waits for
one piece at most, never for a whole plan of many steps. A read takes the
chunks it needs (`take`): those an entry holds come
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
# Extents one hold of the lock plans at most (or one group's, if more): a
# plan of many steps is made a piece at a time, so another request's plan
# or read waits for one piece at most (a few ms), not for the whole plan.
ROWS_PER_HOLD = 2048

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


def _rows(needs: Needs) -> int:
  return sum(len(extents) for _, extents in needs)


def _pieces(todo: Sequence[tuple[Hashable, Needs]]) -> list[tuple[int, int]]:
  """`todo` cut into runs of groups [first, last) of at most ROWS_PER_HOLD
  extents (a bigger group is a run of its own): what one hold of the lock
  handles."""
  out: list[tuple[int, int]] = []
  first, rows = 0, 0
  for k, (_, needs) in enumerate(todo):
    n = _rows(needs)
    if k > first and rows + n > ROWS_PER_HOLD:
      out.append((first, k))
      first, rows = k, 0
    rows += n
  if first < len(todo):
    out.append((first, len(todo)))
  return out


def _coalesced_bytes(new: dict[ObjectRef, list[tuple[int, int, int]]], groups: int) -> int:
  """The bytes of the ranges the first `groups` groups' extents (per
  object, sorted, each with the first group needing it) coalesce into."""
  return sum(b - a for extents in new.values()
             for a, b in coalesce([(a, b) for a, b, k in extents if k < groups]))


def _entries(new: dict[ObjectRef, list[tuple[int, int, int]]], groups: int
             ) -> list[tuple[int, _Entry]]:
  """The ranges the first `groups` groups' extents coalesce into, as
  entries, each with the first group that needs it, in that order: the
  first step's ranges are requested first."""
  made: list[tuple[int, _Entry]] = []
  for obj, extents in new.items():
    ordered = [e for e in extents if e[2] < groups]
    i = 0
    for begin, end in coalesce([(a, b) for a, b, _ in ordered]):
      group = groups
      while i < len(ordered) and ordered[i][1] <= end:
        group = min(group, ordered[i][2])
        i += 1
      made.append((group, _Entry(obj, begin, end, concurrent.futures.Future())))
  made.sort(key=lambda m: m[0])
  return made


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
    (it stops at the first that does not fit).

    Linear in the extents, and the lock is held for a piece of at most
    ROWS_PER_HOLD extents (or one group) at a time: which extents entries
    hold is looked up a piece at a time; the budget and the ranges are
    worked out without the lock; the entries are indexed, and their groups
    planned, a piece at a time, each piece's ranges requested before the
    next is indexed (the first step's first). What changed between pieces
    (another plan, a release) costs bytes at most, never exactness: a
    group takes only the entries it finds when it is planned."""
    if self.budget_bytes <= 0:
      return 0
    now = time.monotonic()
    # Outside the lock: the needs as lists (a dataset may compute them lazily).
    todo = [(tag, [(obj, list(extents)) for obj, extents in needs]) for tag, needs in groups]
    pieces = _pieces(todo)
    skipped: set[int] = set()  # groups planned before, or named twice
    new = self._unheld(todo, pieces, skipped, now)
    fit = self._fit(new, len(todo))
    made = _entries(new, fit)
    planned = 0
    j = 0  # the next of `made` to index
    for first, last in pieces:
      if first >= fit:
        break
      last = min(last, fit)
      with self._lock:
        stop = last
        added: list[_Entry] = []
        while j < len(made) and made[j][0] < last:
          group, entry = made[j]
          if self._bytes + entry.size > self.budget_bytes:  # another plan took the room
            stop = group
            break
          if self._add(entry):
            added.append(entry)
          j += 1
        for k in range(first, stop):
          tag, needs = todo[k]
          if k in skipped or tag in self._groups:
            continue
          if len(self._groups) >= MAX_GROUPS:
            stop = k
            break
          self._attach(tag, needs, now)
          planned += 1
        for entry in added:  # no group needs it (a group that did not fit, or planned meanwhile)
          if entry.uses == 0:
            self._remove(entry)
        fetches = [e for e in added if e.uses > 0]
        held_bytes = self._bytes
      objects_lib.objects().fetch_later([(e.obj, e.begin, e.end) for e in fetches],
                                        [e.future for e in fetches])
      if fetches:
        self.counts.storage_bytes(dataset, fetched=sum(e.size for e in fetches), planned=True)
      self.counts.read_ahead_bytes(held_bytes)
      if stop < last:
        break
    return planned

  def _unheld(self, todo: Sequence[tuple[Hashable, Needs]], pieces: list[tuple[int, int]],
              skipped: set[int], now: float) -> dict[ObjectRef, list[tuple[int, int, int]]]:
    """Per object, the extents of `todo` no entry holds, each once with the
    first group that needs it, sorted; the groups planned before (or named
    twice) go to `skipped`. Looked up a piece at a time."""
    new: dict[ObjectRef, list[tuple[int, int, int]]] = {}
    seen: dict[ObjectRef, set[tuple[int, int]]] = {}
    tags: set[Hashable] = set()
    with self._lock:
      self._sweep(now)
    for first, last in pieces:
      with self._lock:
        for k in range(first, last):
          tag, needs = todo[k]
          if tag in self._groups or tag in tags:
            skipped.add(k)
            continue
          tags.add(tag)
          for obj, extents in needs:
            known, out = seen.setdefault(obj, set()), new.setdefault(obj, [])
            for e in extents:
              if e not in known and self._find(obj, *e) is None:
                known.add(e)
                out.append((e[0], e[1], k))
    for extents in new.values():
      extents.sort()
    return new

  def _fit(self, new: dict[ObjectRef, list[tuple[int, int, int]]], groups: int) -> int:
    """How many of the first groups fit the budget: all, else bisected
    (each try linear in the extents)."""
    held = self._bytes  # read once, unlocked: indexing checks the budget again
    if held + _coalesced_bytes(new, groups) <= self.budget_bytes:
      return groups
    lo, hi = 0, groups  # lo fits, hi does not
    while hi - lo > 1:
      mid = (lo + hi) // 2
      if held + _coalesced_bytes(new, mid) > self.budget_bytes:
        hi = mid
      else:
        lo = mid
    return lo

  def _attach(self, tag: Hashable, needs: Needs, now: float) -> None:
    """Plans group `tag` (under _lock): it uses the entries that hold its extents."""
    entries = {id(e): e for obj, extents in needs for e in
               (self._find(obj, *x) for x in extents) if e is not None}
    for entry in entries.values():
      entry.uses += 1
    self._groups[tag] = (now, list(entries.values()))

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
