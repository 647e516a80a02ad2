"""Cancellation inside a global batch: production stops when its request does.

A stream dataset's global batch is G elements of a Grain pipeline pulled one
by one through its head; one request for one row can make a worker produce
a large G. So the head checks, before each element, whether the request
producing it is still wanted (its client is there and its deadline has not
passed), and raises `Cancelled` if not: CPU stops within one element, not
one batch. The request sets what to check, for its own thread, around the
production (`producing_for`); code outside one never stops.

A pipeline interrupted this way stands in the middle of a batch: its
iterator must be thrown away (server/serving/stream_sessions.py does).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import grain

from grain_elevator.proto.errors import Cancelled

_current = threading.local()


@contextlib.contextmanager
def producing_for(is_active: Callable[[], bool]) -> Iterator[None]:
  """Within: production in this thread stops once `is_active()` is False."""
  before = getattr(_current, "is_active", None)
  _current.is_active = is_active
  try:
    yield
  finally:
    _current.is_active = before


def check() -> None:
  """Raises Cancelled if this thread produces for a request no longer wanted."""
  is_active = getattr(_current, "is_active", None)
  if is_active is not None and not is_active():
    raise Cancelled("the request was cancelled or passed its deadline while its "
                    "global batch was being produced")


class Checked(grain.IterDataset):
  """`parent`, checking `check()` before each element; states pass through
  unchanged, so positions are those of `parent`."""

  def __init__(self, parent: grain.IterDataset):
    super().__init__(parent)

  def __iter__(self) -> grain.DatasetIterator:
    return _CheckedIterator(iter(self._parent))


class _CheckedIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)

  def __next__(self) -> Any:
    check()
    return next(self._parent)

  def get_state(self) -> Any:
    return self._parent.get_state()

  def set_state(self, state: Any) -> None:
    self._parent.set_state(state)
