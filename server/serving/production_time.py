"""How long this worker takes to make a step of each dataset: what it tells
a client that asks (Batch.production_us), so that the client sizes its
requests by worker time rather than by bytes (client/request_size.py).

Kept per row of each dataset, so that one figure serves every global batch
size and host count (a host's step of G/H rows takes about G/H rows' time),
as an exponential average over the steps this worker made: it follows a
mixture's schedule and a cache warming up within a few steps. Steps taken
from the batch cache cost nothing to make and are not counted: the next
request may well miss. The time is the step's wall time on the worker,
waits for reads and for the worker's other requests included: what a
client waiting on a request sees.
"""

from __future__ import annotations

# Weight of the latest step in the average: ~10 steps to follow a change.
WEIGHT = 0.2


class ProductionTimes:
  """Seconds per row of each dataset, as this worker made them lately. Its
  request threads update it without a lock: each update is one dict store,
  and a lost one only ages the average by a step."""

  def __init__(self) -> None:
    self._per_row: dict[str, float] = {}

  def made(self, dataset: str, rows: int, seconds: float) -> None:
    """A step of `rows` rows of `dataset` took `seconds` to make."""
    now = seconds / max(1, rows)
    before = self._per_row.get(dataset)
    self._per_row[dataset] = now if before is None else before + WEIGHT * (now - before)

  def step_us(self, dataset: str, rows: int) -> int:
    """Microseconds a step of `rows` rows of `dataset` takes (0: none made yet)."""
    per_row = self._per_row.get(dataset)
    return 0 if per_row is None else max(1, round(per_row * rows * 1e6))
