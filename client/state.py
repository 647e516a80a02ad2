"""The client's checkpointable state: a global cursor plus what defines the stream.

The cursor is the next *global* step, so one state is valid on every host
and for any number of hosts H: a job restored on fewer hosts resumes at the
same step. The other fields let `check` refuse a cursor from another stream.

The global batch size G may change at a checkpoint (a batch-size ramp-up,
256 -> 512): the records are the same whatever G, so a state saved at step k
under G0 resumes at record k*G0, and steps count afresh from there under the
new G ("record_offset", present only once that has happened; the contract,
proto/contract.py). Nothing is skipped or repeated.

A stream dataset (server/data/streams/stream.py) has no arithmetic from steps to
records: its state also holds "stream_state", the position of its Grain
pipeline where the next global batch starts (Grain's own iterator state,
JSON: an upstream position and a few counters, never elements; at step 0
the dataset's first position, DatasetInfo.stream_start). A new G continues
from that position, steps counted afresh. A stream of N sub-streams
(server/data/streams/sub_streams.py) holds the list of their N positions
there, and a new G must be a multiple of N.

Skips (rollback-and-skip after a loss spike): "skips" lists the ranges of
global steps [a, b) a job skipped, oldest first, so that a resume from any
later checkpoint, on any host count and replica, continues the same stream,
and the trainer's own step count maps back to the data's (`trained_steps`).
Every range ends at or before "step", except that the last may hold it
(a <= step < b): a skip still to be made, as `elevator cursor skip` writes
it into a saved state; the iterator that loads it moves to b (1:1 datasets
in O(1), a stream dataset with one Skip call to the server). A state without
"version" is one from before skips (version 1) and loads as it always did.

A state read from a file (`read`, `parse`) is bounded before it is parsed:
at most MAX_STATE_BYTES, nesting at most MAX_STATE_DEPTH deep, so a file of
any content gets an error naming it and what is wrong, never Python's own
RecursionError. A skip still to be made of a stream dataset is made by the
servers, which compute every skipped batch: it may hold at most
MAX_STREAM_SKIP_ROWS rows (steps times G).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from typing import Any

from grain_elevator.client.read_spec import Kind, ReadSpec
from grain_elevator.proto import contract
from grain_elevator.proto.errors import InvalidRequestError, StreamMismatchError
from grain_elevator.proto.spec import DatasetInfo

# Fields that define the record stream; G, H and h deliberately are not among them.
_STREAM_KEYS = ("dataset", "seed", "config_fingerprint")
# The cursor's format: 2 added "skips". A state without "version" is 1.
CURSOR_VERSION = 2
# Skip ranges one state holds (each a separate rollback; adjacent ones merge).
MAX_SKIP_RANGES = 64
# A state file's size: a cursor is a few hundred bytes, its stream_state at
# most MAX_STREAM_STATE_BYTES (proto/limits.py).
MAX_STATE_BYTES = 1 << 20
# Arrays and objects open at once in a state (a Grain iterator state nests a
# level per transformation; json.loads fails near Python's recursion limit).
MAX_STATE_DEPTH = 128
# Rows (steps times G) of a stream dataset's skip still to be made: each is
# computed by the servers, MAX_SKIP_ROWS per Skip call, before the job resumes.
MAX_STREAM_SKIP_ROWS = 1 << 26

# A JSON string, or an unterminated one to the end of the text: each match
# ends where the next begins, so stripping them is linear (a pattern that
# needs the closing quote is retried from every quote: quadratic on text
# such as `\\"` repeated, seconds for 20 KB).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")

Skips = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Next global step, counted from `record_offset` records into the stream;
  for a stream dataset, the position where that step starts (its JSON text,
  "" at the stream's start), one per sub-stream (one for a stream of one)."""

  step: int
  record_offset: int = 0
  skips: Skips = ()  # ranges [a, b) of steps skipped; the last may still be to make
  positions: tuple[str, ...] = ()  # a stream dataset's; () at its start

  @property
  def pending(self) -> int | None:
    """Where a skip still to be made ends (the step the iterator moves to),
    or None."""
    if self.skips and self.skips[-1][0] <= self.step < self.skips[-1][1]:
      return self.skips[-1][1]
    return None


def add_skip(skips: Skips, step: int, num_steps: int) -> Skips:
  """`skips` with [step, step + num_steps) added (merged with a range
  ending at `step`, or extending one still to be made that holds it)."""
  if num_steps == 0:
    return skips
  if skips and skips[-1][0] <= step <= skips[-1][1]:
    a, b = skips[-1]
    merged = (a, max(b, step) + num_steps)
    return skips[:-1] + (merged,)
  if len(skips) >= MAX_SKIP_RANGES:
    raise InvalidRequestError(
        f"a cursor holds at most {MAX_SKIP_RANGES} skip ranges, and this one has "
        f"{len(skips)}: skip from the end of the last one, or start from a fresh state")
  return skips + ((step, step + num_steps),)


def read(path: str | os.PathLike[str]) -> Any:
  """The JSON in the state file `path`, read and parsed within the bounds
  (module docstring); InvalidRequestError naming the file otherwise."""
  with open(path, "rb") as f:
    data = f.read(MAX_STATE_BYTES + 1)
  if len(data) > MAX_STATE_BYTES:
    raise InvalidRequestError(f"state file {os.fspath(path)}: over the {MAX_STATE_BYTES} "
                              "bytes a saved state may take (MAX_STATE_BYTES); is it a "
                              "grain-elevator state?")
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise InvalidRequestError(f"state file {os.fspath(path)}: not UTF-8 text "
                              f"(byte {e.start})") from None
  return parse(text, f"state file {os.fspath(path)}")


def parse(text: str, source: str = "state") -> Any:
  """`text`, a saved state's JSON, parsed within the bounds (module
  docstring); InvalidRequestError naming `source` and the problem otherwise."""
  if len(text) > MAX_STATE_BYTES:
    raise InvalidRequestError(f"{source}: {len(text)} characters, over the "
                              f"{MAX_STATE_BYTES} a saved state may take (MAX_STATE_BYTES)")
  depth = _depth(text)
  if depth > MAX_STATE_DEPTH:
    raise InvalidRequestError(f"{source}: arrays and objects nested {depth} deep, over the "
                              f"{MAX_STATE_DEPTH} a saved state may nest (MAX_STATE_DEPTH)")
  try:
    return json.loads(text)
  except ValueError as e:
    raise InvalidRequestError(f"{source}: not JSON: {e}") from None


def _depth(text: str) -> int:
  """How deep JSON `text` nests arrays and objects (brackets in strings
  not counted), without parsing it: linear in its length."""
  brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
  return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _nesting(value: Any) -> int:
  """How deep a parsed state nests dicts and lists, walked without
  recursion and stopping past MAX_STATE_DEPTH."""
  deepest, todo = 0, [(value, 1)]
  while todo:
    node, depth = todo.pop()
    if isinstance(node, (dict, list)):
      deepest = max(deepest, depth)
      if depth > MAX_STATE_DEPTH:
        break
      todo.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
  return deepest


def _check_stream_skip(state: dict[str, Any], step: int, end: int, g: int) -> None:
  """InvalidRequestError if a stream state's skip still to be made,
  [step, end), is more than MAX_STREAM_SKIP_ROWS rows of G."""
  rows = (end - step) * g
  if rows > MAX_STREAM_SKIP_ROWS:
    most = max(1, MAX_STREAM_SKIP_ROWS // g)
    raise InvalidRequestError(
        f"dataset {state.get('dataset', '')!r} is a stream dataset, whose skipped batches "
        f"the servers compute before the job resumes: a skip of {end - step} steps of "
        f"G={g} is {rows} rows, over the {MAX_STREAM_SKIP_ROWS} one skip may make "
        f"(MAX_STREAM_SKIP_ROWS, {most} steps of this G); skip fewer")


def with_skip(state: dict[str, Any], num_steps: int) -> dict[str, Any]:
  """A saved state that skips `num_steps` more global batches from its step
  (`elevator cursor skip`): the range is written as a skip still to be
  made, which the iterator loading it makes (1:1 datasets in O(1), a stream
  dataset with one server call). Needs no server; checks what it can
  without one (the state's own fields, and a count that fits the wire)."""
  if not isinstance(state, dict) or not isinstance(state.get("step"), int):
    raise InvalidRequestError("not a grain-elevator state: no integer 'step' (is this the "
                              "data iterator's state, as a Grain checkpoint saves it?)")
  _check_nesting(state)
  step = _int(state, "step")
  version = _int(state, "version", 1, minimum=1)
  if version > CURSOR_VERSION:
    raise InvalidRequestError(f"this state is of cursor version {version}, newer than this "
                              f"grain-elevator's {CURSOR_VERSION}")
  skips = _skips(state.get("skips", []), step)
  g = _int(state, "global_batch_size", minimum=1)
  contract.check_skip(step, num_steps, g, _int(state, "record_offset", 0),
                      dataset=str(state.get("dataset", "")))
  skips = add_skip(skips, step, num_steps)
  if "stream_state" in state and skips and skips[-1][1] > step:
    _check_stream_skip(state, step, skips[-1][1], g)
  out = {**state, "version": CURSOR_VERSION}
  if skips:
    out["skips"] = [list(r) for r in skips]
  return out


def trained_steps(state: dict[str, Any]) -> int:
  """Batches a job resumed from `state` has been given: its step less the
  steps skipped before it (the trainer's own step count, if it counts
  from 0 with this dataset at one G)."""
  return state["step"] - sum(min(b, state["step"]) - a for a, b in state.get("skips", ()))


def make(cursor: Cursor, spec: ReadSpec) -> dict[str, Any]:
  """The JSON-safe state for `cursor` of what `spec` reads (described)."""
  info = spec.require_info()
  state = {
      "step": cursor.step,
      "dataset": info.name,
      "global_batch_size": spec.global_batch_size,
      "seed": info.seed,
      "config_fingerprint": info.cursor_fingerprint(cursor.step),
      "version": CURSOR_VERSION,
  }
  if cursor.skips:
    state["skips"] = [list(r) for r in cursor.skips]
  if cursor.record_offset:
    state["record_offset"] = cursor.record_offset
  if spec.kind is Kind.STREAM:  # a Grain state, or a list of N for N sub-streams
    n = info.stream_shards
    saved = [json.loads(p) if p else None for p in cursor.positions or ("",) * n]
    state["stream_state"] = saved if n > 1 else saved[0]
  return state


def _check_nesting(state: dict[str, Any]) -> None:
  depth = _nesting(state)
  if depth > MAX_STATE_DEPTH:
    raise InvalidRequestError(f"a grain-elevator state nests dicts and lists at most "
                              f"{MAX_STATE_DEPTH} deep (MAX_STATE_DEPTH); this one more")


def _int(state: dict[str, Any], key: str, default: int | None = None, minimum: int = 0) -> int:
  value = state.get(key, default)
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise InvalidRequestError(f"state {key} must be an integer >= {minimum}, got {value!r}")
  return value


def check(state: Any, spec: ReadSpec) -> Cursor:
  """Validates a saved state for what `spec` reads (described); returns
  where it resumes under the spec's global batch size (which may differ
  from the one it was saved with)."""
  info, global_batch_size = spec.require_info(), spec.global_batch_size
  if not isinstance(state, dict):
    raise InvalidRequestError(
        f"a grain-elevator state must be a dict, got {type(state).__name__}")
  _check_nesting(state)
  missing = [k for k in ("step", "global_batch_size") + _STREAM_KEYS if k not in state]
  if missing:
    raise InvalidRequestError(
        f"not a grain-elevator state: missing {', '.join(missing)} (got keys "
        f"{sorted(state)})")
  step = _int(state, "step")
  version = _int(state, "version", 1, minimum=1)
  if version > CURSOR_VERSION:
    raise InvalidRequestError(
        f"this state is of cursor version {version}, saved by a newer grain-elevator; this "
        f"one reads versions up to {CURSOR_VERSION}")
  skips = _skips(state.get("skips", []), step)
  expected = make(Cursor(step), spec)
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
  if spec.kind is Kind.STREAM:
    return _stream_cursor(state, info, saved_g, global_batch_size, step, offset, skips)
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
  cursor = Cursor(step, offset, skips=skips)
  if cursor.pending is not None:  # a skip to make: O(1), the steps are arithmetic
    contract.check_skip(step, cursor.pending - step, saved_g, offset, steps, info.name)
    cursor = dataclasses.replace(cursor, step=cursor.pending)
  if saved_g == global_batch_size:
    return cursor
  # A new G: steps count afresh from the record reached (the end, at most),
  # and the skips, named in the old steps, are behind it.
  return Cursor(0, min(offset + cursor.step * saved_g, info.stream_length))


def _skips(value: Any, step: int) -> Skips:
  """A state's "skips", checked: ranges [a, b) with 0 <= a < b, in order,
  apart, at most MAX_SKIP_RANGES, each ending at or before `step` but for
  the last, which may hold it (a skip still to be made)."""
  if not isinstance(value, list) or len(value) > MAX_SKIP_RANGES:
    raise InvalidRequestError(f"state skips must be a list of at most {MAX_SKIP_RANGES} "
                              "[first, end) step ranges")
  out: list[tuple[int, int]] = []
  for i, r in enumerate(value):
    if (not isinstance(r, list) or len(r) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        or not 0 <= r[0] < r[1] or r[1] > contract.MAX_RECORD_POSITION):
      raise InvalidRequestError(f"state skips[{i}] must be [first, end) with "
                                f"0 <= first < end, got {r!r}")
    if out and r[0] <= out[-1][1]:
      raise InvalidRequestError(f"state skips[{i}] {r!r} does not come after the range "
                                f"before it, {list(out[-1])}")
    last = i == len(value) - 1
    if r[0] > step or (r[1] > step and not last):
      raise InvalidRequestError(
          f"state skips[{i}] {r!r} lies ahead of the state's step {step}: a skip starts "
          "at the step where it is made")
    out.append((r[0], r[1]))
  return tuple(out)



def _stream_cursor(state: dict[str, Any], info: DatasetInfo, saved_g: int,
                   global_batch_size: int, step: int, offset: int, skips: Skips) -> Cursor:
  """A stream dataset's cursor: its position, checked for shape only (the
  server refuses one that is not a position of its pipeline)."""
  if offset:
    raise InvalidRequestError(f"dataset {info.name!r} is a stream dataset: a state "
                              "continues from its stream_state, not a record_offset")
  if "stream_state" not in state:
    raise InvalidRequestError(f"not a state of stream dataset {info.name!r}: it has no "
                              "stream_state (saved for the dataset before it was a stream?)")
  contract.check_stream_shards(global_batch_size, info.stream_shards, info.name)
  positions = saved_positions(state["stream_state"], info, "a state's stream_state")
  cursor = Cursor(step, skips=skips, positions=positions)
  if cursor.pending is not None:
    _check_stream_skip(state, step, cursor.pending, saved_g)
  if saved_g == global_batch_size:
    return cursor  # a skip still to make: the iterator asks the servers (Skip calls)
  if cursor.pending is not None:
    raise InvalidRequestError(
        f"this state of stream dataset {info.name!r} holds a skip still to be made, of "
        f"batches of {saved_g}: resume it under global_batch_size {saved_g} first (a "
        "stream's batches depend on G), then change G at a later checkpoint")
  return Cursor(0, positions=positions)  # a new G: steps count afresh from the positions


def saved_positions(value: Any, info: DatasetInfo, where: str) -> tuple[str, ...]:
  """A saved `stream_state` (`where` names it in errors) as canonical
  position texts, one per sub-stream ("" for null: its start): a Grain
  state or null for one stream, a list of N of them for N sub-streams;
  InvalidRequestError naming what is wrong otherwise. Only its shape is
  checked: the server refuses a position of another pipeline."""
  n = info.stream_shards
  if n == 1:
    return (_position(value, where),)
  if not isinstance(value, list) or len(value) != n:
    got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
    raise InvalidRequestError(
        f"dataset {info.name!r} has {n} sub-streams: {where} is a list of their {n} "
        f"positions (one a sub-stream), got {got}")
  return tuple(_position(p, f"{where}[{j}]") for j, p in enumerate(value))


def _position(position: Any, where: str) -> str:
  """One saved position as canonical text ("" for null: the start)."""
  if position is not None and not isinstance(position, dict):
    raise InvalidRequestError(
        f"{where} must be a Grain iterator state (a JSON object) or null: it is a "
        f"position of the stream, got {type(position).__name__}")
  return contract.position_text(position) if position else ""
