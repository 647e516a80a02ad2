"""How a failure while making a step leaves the request path: named with the
dataset and step (and a stream's position, cut short), as the same
ElevatorError class or, from the pipeline, DATA_LOSS; and logged at most once
a period for each dataset and kind, since a client retrying a bad request in
a loop fails by the hundred."""

from __future__ import annotations

import logging
from typing import Any, Callable

from grain_elevator.proto.errors import Cancelled, DataLossError, ElevatorError
from grain_elevator.proto.throttle import Throttled

log = logging.getLogger("grain_elevator.server")

# How much of a stream position an error message shows.
_POSITION_SHOWN = 200
_LOG_PERIOD_S = 10.0
failures = Throttled(_LOG_PERIOD_S, log)


def named(dataset: str, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """`fn(...)`, its failure re-raised with `where` (the dataset and step)
  in front of its message: as the same ElevatorError class, or, for an
  exception from the pipeline, DATA_LOSS (this step's data cannot be made).
  A cancelled request is no failure. Logged at most once a period for each
  dataset and kind (the first with its traceback)."""
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


def where(dataset: str, step: int, position: str | None = None) -> str:
  """Where a failure happened; a stream's position (JSON) is cut short."""
  out = f"dataset {dataset!r}, step {step}"
  if position is not None:
    out += f" (stream position {position[:_POSITION_SHOWN]}"
    out += "...)" if len(position) > _POSITION_SHOWN else ")"
  return out
