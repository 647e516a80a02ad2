"""How a failure while making a step leaves the request path: named with the
dataset and step (and a stream's position, cut short), as the same
ElevatorError class or, from the pipeline, DATA_LOSS; and logged at most once
a period for each dataset and kind, since a client retrying a bad request in
a loop fails by the hundred.

A step whose making killed a worker of this server (a segfault in the
pipeline: server/process/step_board.py) is refused with DATA_LOSS naming it,
never made again: in a worker, `named` notes each step its thread makes on
the worker's board, and refuses one the supervisor has posted as failed. A
step is known by its `where` and the request it is made for (`serving`)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from typing import Any, Callable, Iterator, TypeVar

from grain_elevator.proto.errors import Cancelled, DataLossError, ElevatorError
from grain_elevator.proto.throttle import Throttled

log = logging.getLogger("grain_elevator.server")
T = TypeVar("T")

# How much of a stream position an error message shows.
_POSITION_SHOWN = 200
_LOG_PERIOD_S = 10.0
failures = Throttled(_LOG_PERIOD_S, log)

# This worker's side of the server's step board (step_board.WorkerSteps;
# worker.run sets it); None in embedded mode and in tests without workers.
_board: Any = None
# The request the current thread makes steps for (`serving`).
_request = threading.local()


def key_of(step: str) -> int:
  """A step's 64-bit key on the board (never 0: 0 marks a free entry)."""
  return int.from_bytes(hashlib.blake2b(step.encode(), digest_size=8).digest(), "little") or 1


def use_board(board: Any) -> None:
  """Makes `named` note and check steps on `board` (a WorkerSteps)."""
  global _board
  _board = board


@contextlib.contextmanager
def serving(request: str) -> Iterator[None]:
  """While in it, the steps this thread makes are for `request` (its kind
  and geometry: what, with `where`, tells one step from another)."""
  previous = getattr(_request, "text", None)
  _request.text = request
  try:
    yield
  finally:
    _request.text = previous


def each_serving(request: str, items: Iterator[T]) -> Iterator[T]:
  """`items`, each made within `serving(request)`: a generator may be
  resumed from any thread, so the request is set around each step."""
  try:
    while True:
      with serving(request):
        try:
          item = next(items)
        except StopIteration:
          return
      yield item
  finally:
    close = getattr(items, "close", None)
    if close is not None:  # its own `finally` now, not when collected
      close()


def named(dataset: str, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """`fn(...)`, its failure re-raised with `where` (the dataset and step)
  in front of its message: as the same ElevatorError class, or, for an
  exception from the pipeline, DATA_LOSS (this step's data cannot be made).
  A cancelled request is no failure. Logged at most once a period for each
  dataset and kind (the first with its traceback). A step that killed a
  worker of this server is DATA_LOSS at once."""
  board, request = _board, getattr(_request, "text", None)
  entry = None
  if board is not None and request is not None:
    step = f"{where}, {request}"
    key = key_of(step)
    killed = board.failed(key)
    if killed is not None:
      failures.warning((dataset, "killed"), "refused: %s", killed)
      raise DataLossError(
          f"{where}: refused: making it killed a worker of this server ({killed}); it "
          "is not made again. A record of this step crashes the dataset's pipeline "
          "(elevator explain lists the step's records)")
    entry = board.begin(key, step)
  try:
    return fn(*args, **kwargs)
  except Cancelled:
    raise
  except ElevatorError as e:  # e.g. DATA_LOSS naming the shard and record
    failures.warning((dataset, type(e)), "%s: %s", where, e)
    raise type(e)(f"{where}: {e}") from e
  except Exception as e:  # pylint: disable=broad-except
    failures.warning((dataset, type(e)), "%s failed", where, exc_info=True)
    raise DataLossError(f"{where}: {type(e).__name__}: {e}") from e
  finally:
    if entry is not None:
      board.end(entry)


def where(dataset: str, step: int, position: str | None = None) -> str:
  """Where a failure happened; a stream's position (JSON) is cut short."""
  out = f"dataset {dataset!r}, step {step}"
  if position is not None:
    out += f" (stream position {position[:_POSITION_SHOWN]}"
    out += "...)" if len(position) > _POSITION_SHOWN else ")"
  return out
