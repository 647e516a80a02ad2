"""What `elevator convert jsonl` checks of a JSON line, in bounded memory.

`json.loads` builds every value of a line as a Python object: ~24 bytes of
memory per byte of `[{},{},...]`, so a valid 48 MiB line needed 1.3 GB to
check, and the serving pipeline (pipelines/text.py) parses each record the
same way. So a line may hold at most `max_values` JSON values (each object,
array, key, string, number, true, false or null is one; parsing costs Python
up to ~70 bytes a value), and lines are checked without building them:

* A line of at most `max_values` characters cannot hold more values (each
  starts at a character of its own): `json.loads` checks it, in memory
  bounded by ~24 times `max_values` bytes.
* A longer line is walked: json's own C functions read each string
  (`json.decoder.scanstring`) and each number or literal (the decoder's
  `scan_once`), and only a stack of the open containers is kept, so memory
  is bounded by the longest string and `MAX_DEPTH`, whatever the values.
  The walk counts values and stops at the limit. It accepts and refuses what
  `json.loads` does (tests/tools/test_json_check.py compares them).
"""

from __future__ import annotations

import json
import re
from typing import Any

# Containers open at once in a walked line (json.loads stops near Python's
# recursion limit, 1,000, less the caller's frames).
MAX_DEPTH = 512

_DECODER = json.JSONDecoder()
_SCAN_ONCE = _DECODER.scan_once  # a number, true, false, null, NaN, Infinity
_SCANSTRING = json.decoder.scanstring  # the C one where there is one
_WS = json.decoder.WHITESPACE.match
_CLOSE = {"{": "}", "[": "]"}
_KIND = {"{": "an object", "[": "an array"}
# Runs of simple members (after a first one) read by one regex match, so a
# line of a million small values is not a million Python steps: a number of
# at most 100 integer digits (fewer than Python's int_max_str_digits can be
# set to), true, false, null, a string without escapes or commas, {} or [];
# each ends where a delimiter follows. Possessive (`*+`): no backtracking
# state, the regex engine's memory stays constant whatever the run's length.
# A run holds one comma per array item or object member, none elsewhere.
_S = r"[ \t\n\r]*+"
_STRING = r'"[^"\\\x00-\x1f,]*+"'
_SIMPLE = (r"(?:-?(?:0|[1-9][0-9]{0,99})(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null|"
           + _STRING + r"|\{" + _S + r"\}|\[" + _S + r"\])(?=[ \t\n\r,\]}])")
_RUN = {"[": re.compile(f"(?:{_S},{_S}{_SIMPLE})*+"),
        "{": re.compile(f"(?:{_S},{_S}{_STRING}{_S}:{_S}{_SIMPLE})*+")}
_PER_COMMA = {"[": 1, "{": 2}  # values in a run per comma: an item; a key and its value


class TooManyValues(ValueError):
  """The line holds more JSON values than the limit."""


class TooDeep(ValueError):
  """The line nests containers deeper than `MAX_DEPTH`."""


_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
          str: "a string", list: "an array", dict: "an object"}


def kind_of(value: Any) -> str:
  """What a JSON value is, in words."""
  return _KINDS.get(type(value)) or type(value).__name__


def check(text: str, field: str, max_values: int) -> tuple[str, str | None]:
  """(what `text` is, what its top-level `field` holds or None without one).

  Raises json.JSONDecodeError where json.loads would, ValueError for a number
  Python does not convert, TooManyValues over `max_values` values, and
  RecursionError or TooDeep for nesting too deep to read."""
  if len(text) <= max_values:
    obj = json.loads(text)
    if type(obj) is not dict:  # pylint: disable=unidiomatic-typecheck
      return kind_of(obj), None
    return "an object", kind_of(obj[field]) if field in obj else None
  return walk(text, field, max_values)


def _key(s: str, idx: int) -> tuple[str, int]:
  """An object's key at idx, and where its value starts."""
  if s[idx:idx + 1] != '"':
    raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, idx)
  key, idx = _SCANSTRING(s, idx + 1, True)
  idx = _WS(s, idx).end()
  if s[idx:idx + 1] != ":":
    raise json.JSONDecodeError("Expecting ':' delimiter", s, idx)
  return key, _WS(s, idx + 1).end()


def walk(s: str, field: str, max_values: int) -> tuple[str, str | None]:
  """check() for a line of any length: values are counted and read one at a
  time, never held; a stack of the open containers is all that is kept."""
  if s.startswith("\ufeff"):  # as json.loads
    raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", s, 0)
  stack: list[str] = []  # "{" or "[" of each open container
  key = None  # the last key read in the top-level object
  field_kind = None
  values = 0
  idx = _WS(s, 0).end()
  while True:
    # A value starts at idx.
    values += 1
    if values > max_values:
      raise TooManyValues(f"over {max_values:,} JSON values")
    c = s[idx:idx + 1]
    if c in _CLOSE:
      if len(stack) >= MAX_DEPTH:
        raise TooDeep(f"over {MAX_DEPTH} containers deep")
      stack.append(c)
      idx = _WS(s, idx + 1).end()
      if s[idx:idx + 1] != _CLOSE[c]:  # a first member follows
        if c == "{":
          values += 1
          k, idx = _key(s, idx)
          if len(stack) == 1:
            key = k
        continue
      kind = _KIND[stack.pop()]
      idx += 1
    elif c == '"':
      _, idx = _SCANSTRING(s, idx + 1, True)
      kind = "a string"
    else:
      try:
        value, idx = _SCAN_ONCE(s, idx)
      except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", s, e.value) from None
      kind = kind_of(value)
    # A value of `kind` ends at idx: close the containers that end with it.
    while True:
      if not stack:
        end = _WS(s, idx).end()
        if end != len(s):
          raise json.JSONDecodeError("Extra data", s, end)
        return kind, field_kind
      if len(stack) == 1 and stack[0] == "{":
        if key == field:
          field_kind = kind
      else:  # not the top-level object, whose keys are read one by one
        end = _RUN[stack[-1]].match(s, idx).end()
        if end > idx:
          values += s.count(",", idx, end) * _PER_COMMA[stack[-1]]
          if values > max_values:
            raise TooManyValues(f"over {max_values:,} JSON values")
          idx = end
      idx = _WS(s, idx).end()
      c = s[idx:idx + 1]
      if c == ",":
        idx = _WS(s, idx + 1).end()
        if stack[-1] == "{":
          values += 1
          k, idx = _key(s, idx)
          if len(stack) == 1:
            key = k
        break  # the next member's value
      if c != _CLOSE[stack[-1]]:
        raise json.JSONDecodeError("Expecting ',' delimiter", s, idx)
      kind = _KIND[stack.pop()]
      idx += 1
