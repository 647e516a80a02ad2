"""A stream dataset's position as it travels: bounded, parsed, checked by shape.

A position is the JSON of a Grain iterator state (contract.position_text).
Both sides meet positions they did not make: a server receives one with
every request (a trainer's saved cursor, or anything at all), a client one
with every batch. Neither takes it on trust:

  * its length is bounded (limits.MAX_STREAM_STATE_BYTES) before it is parsed;
  * it must have the shape of the stream's first position
    (DatasetInfo.stream_start): the same keys at every level, a whole number
    wherever the first has one (not below zero, unless the first is below
    zero there: Grain's "none" sentinels are -1), a string where a string,
    lists whose items have the shape of the first's items (scalars if it
    has none), and anything where the first has null.

What a shape cannot tell, a position moved along its own stream, only the
pipeline can: a server restores it with Grain's own `set_state` and refuses
one that does not read back the same (server/data/streams/stream.py); a client
cannot tell at all (docs/operations.md, "What a client checks").
"""

from __future__ import annotations

import json
from typing import Any

from grain_elevator.proto.limits import MAX_STREAM_STATE_BYTES

# JSON's numbers beyond int64 are no position of any Grain iterator.
_MAX_INT = (1 << 63) - 1


class BadPosition(ValueError):
  """Not a position of the stream; the message names what, never the
  position's own text (a peer's bytes are not echoed)."""


def parse(text: str, start: str) -> dict[str, Any]:
  """The position `text`, parsed and checked against the shape of the
  stream's first position `start`; BadPosition otherwise."""
  if len(text) > MAX_STREAM_STATE_BYTES:
    raise BadPosition(f"it is {len(text)} bytes, over the {MAX_STREAM_STATE_BYTES} a "
                      "position may take (MAX_STREAM_STATE_BYTES)")
  try:
    value = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise BadPosition(f"it is not JSON ({type(e).__name__})") from None
  if not isinstance(value, dict):
    raise BadPosition(f"it must be a JSON object (a Grain iterator state), not "
                      f"{type(value).__name__}")
  check_shape(value, json.loads(start) if start else {})
  return value


def check_shape(value: Any, like: Any, where: str = "") -> None:
  """BadPosition unless `value` has the shape of `like` (module docstring)."""
  at = where or "the top level"
  if isinstance(like, dict):
    if not isinstance(value, dict):
      raise BadPosition(f"{at} must be an object")
    if set(value) != set(like):
      missing = sorted(set(like) - set(value))
      raise BadPosition(f"{at} must have exactly the keys {sorted(like)}" +
                        (f" (missing {missing})" if missing else " (it has others)"))
    for key, inner in like.items():
      check_shape(value[key], inner, f"{where}.{key}" if where else key)
  elif isinstance(like, list):
    if not isinstance(value, list) or len(value) > MAX_STREAM_STATE_BYTES:
      raise BadPosition(f"{at} must be a list")
    for item in value:
      check_shape(item, like[0] if like else _ANY_SCALAR, f"{at}[]")
  elif isinstance(like, bool):
    if not isinstance(value, bool):
      raise BadPosition(f"{at} must be true or false")
  elif isinstance(like, int):
    if (not isinstance(value, int) or isinstance(value, bool)
        or not min(0, like) <= value <= _MAX_INT):
      raise BadPosition(f"{at} must be a whole number in [{min(0, like)}, {_MAX_INT}]")
  elif isinstance(like, float):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
      raise BadPosition(f"{at} must be a number")
  elif isinstance(like, str):
    if not isinstance(value, str):
      raise BadPosition(f"{at} must be a string")
  elif like is _ANY_SCALAR:  # an item of a list the first position has empty
    if isinstance(value, (dict, list)):
      raise BadPosition(f"{at} must be a number, a string or null")
  # None in the first position: a field Grain fills in later, of any shape
  # (the server's read-back check still applies).


_ANY_SCALAR = object()
