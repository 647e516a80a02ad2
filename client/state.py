"""The client's checkpointable state: a global cursor plus what defines the stream.

The cursor is the next *global* step, so one state is valid on every host
and for any number of hosts H: a job restored on fewer hosts resumes at the
same step. The other fields let `check` refuse a cursor from another stream.
"""

from __future__ import annotations

from typing import Any

from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.proto.errors import InvalidRequestError, StreamMismatchError

# Fields that define the global stream; H and h deliberately are not among them.
_STREAM_KEYS = ("dataset", "global_batch_size", "seed", "config_fingerprint")


def make(step: int, info: DatasetInfo, global_batch_size: int) -> dict[str, Any]:
  """The JSON-safe state for "next global step is `step`"."""
  return {
      "step": step,
      "dataset": info.name,
      "global_batch_size": global_batch_size,
      "seed": info.seed,
      "config_fingerprint": info.config_fingerprint,
  }


def check(state: Any, info: DatasetInfo, global_batch_size: int,
          total_steps: int | None) -> int:
  """Validates a saved state for this stream; returns its step."""
  if not isinstance(state, dict):
    raise InvalidRequestError(
        f"a grain-elevator state must be a dict, got {type(state).__name__}")
  missing = [k for k in ("step",) + _STREAM_KEYS if k not in state]
  if missing:
    raise InvalidRequestError(
        f"not a grain-elevator state: missing {', '.join(missing)} (got keys "
        f"{sorted(state)})")
  expected = make(0, info, global_batch_size)
  diffs = [f"{k}: saved {state[k]!r}, this stream has {expected[k]!r}"
           for k in _STREAM_KEYS if state[k] != expected[k]]
  if diffs:
    raise StreamMismatchError(
        "this state was saved for another stream and cannot resume it ("
        + "; ".join(diffs) + "). A cursor is valid only for the same dataset "
        "config, seed and global batch size; any number of hosts is fine.")
  step = state["step"]
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise InvalidRequestError(f"state step must be an integer >= 0, got {step!r}")
  if total_steps is not None and step > total_steps:
    raise InvalidRequestError(
        f"state step {step} is past the end of dataset {info.name!r}, which has "
        f"{total_steps} steps of global batch size {global_batch_size}")
  return step
