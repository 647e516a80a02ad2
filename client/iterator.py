"""What every iterator of a RemoteDataset shares, whichever reader it is.

An iterator reads what its `ReadSpec` says (client/read_spec.py): it knows
nothing of the RemoteDataset that made it.

A dataset that answers for any step is read by client/step_iterator.py:
requests for chunks of steps, many in flight, any one retried on its own. A
stream dataset is read by client/stream_iterator.py: one request at a time,
each from the position where the last ended. The rest is one skeleton: the
request every chunk is, steps delivered in order to the trainer and metered,
the cursor that `get_state` gives and `set_state` checks, and a life that
ends in `close`, called by the trainer or, for an iterator it dropped, by the
closing thread (client/closing.py).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import grain

from grain_elevator.client import closing
from grain_elevator.client import state as state_lib
from grain_elevator.client import stats as stats_lib
from grain_elevator.client.backend import Backend
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.client.transport.connection import Step
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto.errors import ElevatorError


def no_parent(what: str) -> property:
  """`_parent` for a source of a Grain pipeline, which has none.

  Grain's `_parent` asserts exactly one parent, so on a source it raises
  `AssertionError: ()`. Code that walks a pipeline's chain asks
  `hasattr(it, "_parent")` (MaxText's `MultiHostDataLoadIterator.close()`
  and its `__del__`); `hasattr` lets only an AttributeError through. Raising
  one instead, that code sees a source: `hasattr` is False,
  `getattr(it, "_parent", None)` is None, and `_parents` stays `()`.
  """
  def parent(_: Any) -> Any:
    raise AttributeError(f"a {what} reads from the service: it is a source of the "
                         "pipeline, with no parent (its _parents is ())")
  return property(parent, doc="Absent: a source has no parent (AttributeError).")


class Arrivals(list):
  """A request's steps, appended by a fetch as they arrive; `arrived(step)`
  runs after each, so the trainer may take a step before its request ends."""

  def __init__(self, arrived: Callable[[Step], None]):
    super().__init__()
    self._arrived = arrived

  def append(self, item: Step) -> None:
    super().append(item)
    self._arrived(item)


class ClientIterator(grain.DatasetIterator):
  """The skeleton; a reader fills in how steps are fetched (`_cancel`,
  `_join`), skipped, and where a restored cursor puts it."""

  _parent = no_parent("RemoteDataset iterator")

  def __init__(self, spec: ReadSpec, backend: Backend, in_flight: Callable[[], int]):
    """`spec`: what it reads, described; `in_flight`: the steps the reader
    keeps ahead now (for stats); it must not hold the iterator, or the meter
    would keep it alive."""
    super().__init__()
    self._spec = spec
    self._backend = backend
    self._info = info = spec.require_info()
    self._structure = info.element_spec.structure
    self._step = 0  # the next step the trainer receives
    self._skips: state_lib.Skips = ()  # steps skipped ([a, b) ranges), for the cursor
    self._meter = stats_lib.meter_for(spec, backend, in_flight)
    self._closed = False
    closing.start()  # where a dropped iterator gets closed

  def stats(self) -> stats_lib.Stats:
    """Time waited for data, throughput, retries, fallbacks, the window."""
    return self._meter.stats()

  # -- what a reader uses -----------------------------------------------------

  def _check_open(self) -> None:
    if self._closed:
      raise ElevatorError(f"{self._spec} iterator is closed")

  def _request(self, start: int, num_steps: int, **fields: Any) -> pb.BatchRequest:
    """The request for steps [start, start + num_steps) of this host, its
    batches in the transport's compression."""
    return self._spec.request(start, num_steps, compressed=True, **fields)

  def _delivered(self, called_at: float, leaves: list[Any]) -> Any:
    """A step as the trainer receives it. The whole `__next__` call counts
    as waiting for data: the trainer did nothing else meanwhile."""
    self._meter.delivered(called_at, time.monotonic(),
                          sum(getattr(x, "nbytes", 0) for x in leaves))
    return tree.unflatten(self._structure, leaves)

  def _state(self, cursor: state_lib.Cursor) -> dict[str, Any]:
    return state_lib.make(cursor, self._spec)

  def _cursor(self, state: dict[str, Any]) -> state_lib.Cursor:
    """`state` checked against this dataset and G (a precise error if not)."""
    return state_lib.check(state, self._spec)

  # -- life ---------------------------------------------------------------

  def _cancel(self) -> None:
    """Ends every fetch in flight without waiting for it."""
    raise NotImplementedError

  def _join(self) -> None:
    """Waits for the fetches `_cancel` ended (after the backend is closed)."""
    raise NotImplementedError

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._cancel()
    self._backend.close()
    self._join()

  # `later` bound now: at interpreter exit this module's globals may already
  # be None when a finalizer runs.
  def __del__(self, _later=closing.later) -> None:
    if not getattr(self, "_closed", True):  # closed by the closing thread (client/closing.py)
      _later(self.close)

  def __str__(self) -> str:
    return f"{self._spec} @ step {self._step}"
