"""The client's checkpointable state: a global cursor plus what defines the stream.

The cursor is the next *global* step, so one state is valid on every host
and for any number of hosts H: a job restored on fewer hosts resumes at the
same step. The other fields let `check` refuse a cursor from another stream.

The global batch size G may change at a checkpoint (a batch-size ramp-up,
256 -> 512): the records are the same whatever G, so a state saved at step k
under G0 resumes at record k*G0, and steps count afresh from there under the
new G ("record_offset", present only once that has happened; the contract,
proto/contract.py). Nothing is skipped or repeated.

A stream dataset (server/data/stream.py) has no arithmetic from steps to
records: its state also holds "stream_state", the position of its Grain
pipeline where the next global batch starts (Grain's own iterator state,
JSON: an upstream position and a few counters, never elements; at step 0
the dataset's first position, DatasetInfo.stream_start). A new G continues from that position, steps counted afresh.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from grain_elevator.proto import contract
from grain_elevator.proto.errors import InvalidRequestError, StreamMismatchError
from grain_elevator.proto.spec import DatasetInfo

# Fields that define the record stream; G, H and h deliberately are not among them.
_STREAM_KEYS = ("dataset", "seed", "config_fingerprint")


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Next global step, counted from `record_offset` records into the stream;
  for a stream dataset, the position where that step starts (its JSON text,
  "" at the stream's start)."""

  step: int
  record_offset: int = 0
  stream_state: str = ""


def make(cursor: Cursor, info: DatasetInfo, global_batch_size: int) -> dict[str, Any]:
  """The JSON-safe state for `cursor`."""
  state = {
      "step": cursor.step,
      "dataset": info.name,
      "global_batch_size": global_batch_size,
      "seed": info.seed,
      "config_fingerprint": info.cursor_fingerprint(cursor.step),
  }
  if cursor.record_offset:
    state["record_offset"] = cursor.record_offset
  if info.stream:
    state["stream_state"] = json.loads(cursor.stream_state) if cursor.stream_state else None
  return state


def _int(state: dict[str, Any], key: str, default: int | None = None, minimum: int = 0) -> int:
  value = state.get(key, default)
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise InvalidRequestError(f"state {key} must be an integer >= {minimum}, got {value!r}")
  return value


def check(state: Any, info: DatasetInfo, global_batch_size: int) -> Cursor:
  """Validates a saved state for this stream; returns where it resumes under
  `global_batch_size` (which may differ from the one it was saved with)."""
  if not isinstance(state, dict):
    raise InvalidRequestError(
        f"a grain-elevator state must be a dict, got {type(state).__name__}")
  missing = [k for k in ("step", "global_batch_size") + _STREAM_KEYS if k not in state]
  if missing:
    raise InvalidRequestError(
        f"not a grain-elevator state: missing {', '.join(missing)} (got keys "
        f"{sorted(state)})")
  step = _int(state, "step")
  expected = make(Cursor(step), info, global_batch_size)
  diffs = [f"{k}: saved {state[k]!r}, this stream has {expected[k]!r}"
           for k in _STREAM_KEYS if state[k] != expected[k]]
  if len(info.segment_steps) > 1 and state["global_batch_size"] != global_batch_size:
    diffs.append(f"global_batch_size: saved {state['global_batch_size']!r}, this iterator "
                 f"has {global_batch_size}, and a scheduled mixture counts its segments in "
                 "steps of it")
  if diffs:
    raise StreamMismatchError(
        "this state was saved for another stream and cannot resume it ("
        + "; ".join(diffs) + "). A cursor is valid only for the same dataset "
        "config and seed (for a mixture: the schedule up to the saved step); "
        "any number of hosts is fine.")
  offset = _int(state, "record_offset", 0)
  saved_g = _int(state, "global_batch_size", minimum=1)
  if info.stream:
    return _stream_cursor(state, info, saved_g, global_batch_size, step, offset)
  if "stream_state" in state:
    raise InvalidRequestError(f"this state has a stream_state, but dataset {info.name!r} is "
                              "not a stream dataset")
  if not info.repeats_forever and offset > info.stream_length:
    raise InvalidRequestError(f"state record_offset {offset} is past the end of dataset "
                              f"{info.name!r}, which has {info.stream_length} records")
  steps = info.total_steps(saved_g, offset)
  if steps is not None and step > steps:
    raise InvalidRequestError(
        f"state step {step} is past the end of dataset {info.name!r}, which has "
        f"{steps} steps of global batch size {saved_g}"
        + (f" after record {offset}" if offset else ""))
  if saved_g == global_batch_size:
    return Cursor(step, offset)
  # A new G: steps count afresh from the record reached (the end, at most).
  return Cursor(0, min(offset + step * saved_g, info.stream_length))



def _stream_cursor(state: dict[str, Any], info: DatasetInfo, saved_g: int,
                   global_batch_size: int, step: int, offset: int) -> Cursor:
  """A stream dataset's cursor: its position, checked for shape only (the
  server refuses one that is not a position of its pipeline)."""
  if offset:
    raise InvalidRequestError(f"dataset {info.name!r} is a stream dataset: a state "
                              "continues from its stream_state, not a record_offset")
  if "stream_state" not in state:
    raise InvalidRequestError(f"not a state of stream dataset {info.name!r}: it has no "
                              "stream_state (saved for the dataset before it was a stream?)")
  position = state["stream_state"]
  if position is not None and not isinstance(position, dict):
    raise InvalidRequestError(f"state stream_state must be a Grain iterator state (a JSON "
                              f"object) or null, got {type(position).__name__}")
  text = contract.position_text(position) if position else ""
  if saved_g == global_batch_size:
    return Cursor(step, stream_state=text)
  return Cursor(0, stream_state=text)  # a new G: steps count afresh from the position
