"""A bounded fuzz of the saved-state parser (client/state.py `parse`), which
reads what a user, a checkpoint or `elevator cursor` hands it: mutants of
real cursors and crafted texts (deep nesting, brackets in strings, escaped
quotes, unterminated strings) are parsed as JSON would parse them, or
refused with InvalidRequestError, never a RecursionError or another
exception, and never in time quadratic in their length."""

from __future__ import annotations

import json
import random
import threading

import pytest

from grain_elevator.client import state as state_lib
from grain_elevator.proto.errors import InvalidRequestError

SEEDS = [
    {"version": 2, "dataset": "lm", "global_batch_size": 8, "step": 12, "skips": [[3, 5]],
     "stream_state": "{\"next_index\": 40, \"parents\": [[1, 2], {\"x\": \"]\\\"[\"}]}"},
    {"dataset": "aug2", "step": 0, "global_batch_size": 4},
    [[[[{"a": ["[", "{", "\\", "\""]}]]]],
]
PIECES = ["[", "]", "{", "}", "\"", "\\", "\\\"", ",", ":", "1", "\"a\"", "\n", "\u00e9",
          "[" * 200, "{\"k\":" * 150, "\"" * 3]


def _mutant(rng: random.Random) -> str:
  text = json.dumps(rng.choice(SEEDS))
  for _ in range(rng.randrange(1, 6)):
    at = rng.randrange(len(text) + 1)
    if rng.random() < 0.3 and text:
      text = text[:at] + text[at + rng.randrange(1, 8):]  # a cut
    else:
      text = text[:at] + rng.choice(PIECES) * rng.randrange(1, 4) + text[at:]
  return text


def _nesting(value: object) -> int:
  if isinstance(value, dict):
    return 1 + max(map(_nesting, value.values()), default=0)
  if isinstance(value, list):
    return 1 + max(map(_nesting, value), default=0)
  return 0


def test_mutated_states_parse_as_json_does_or_are_refused():
  rng = random.Random(44)
  parsed = refused = 0
  for _ in range(3000):
    text = _mutant(rng)
    try:
      got = state_lib.parse(text, "fuzzed state")
    except InvalidRequestError:
      refused += 1
      try:
        want = json.loads(text)
      except (ValueError, RecursionError):
        continue
      # Refused though JSON reads it: only for nesting past the bound.
      assert _nesting(want) > state_lib.MAX_STATE_DEPTH, text[:300]
      continue
    parsed += 1
    assert got == json.loads(text), text[:300]
  assert parsed > 100 and refused > 100, (parsed, refused)  # both sides were reached


@pytest.mark.parametrize("text", [
    "[" + "\\\"" * (state_lib.MAX_STATE_BYTES // 2 - 1),  # escaped quotes, no string ends
    "\"" + "[" * (state_lib.MAX_STATE_BYTES - 1),           # all inside one open string
    "[" * (state_lib.MAX_STATE_BYTES - 1),
], ids=["escaped-quotes", "open-string", "brackets"])
def test_a_largest_hostile_state_is_refused_in_linear_time(text):
  """At MAX_STATE_BYTES, each of these is refused; the first took the old
  depth scan 11 s at 40 KB, quadratic in its length (hours at 1 MiB); now
  well under a second. The 120 s bound is there only so that a regression
  fails instead of hanging the suite."""
  outcome: list[BaseException | None] = []

  def parse() -> None:
    try:
      state_lib.parse(text, "hostile state")
      outcome.append(None)
    except BaseException as e:  # pylint: disable=broad-except
      outcome.append(e)

  worker = threading.Thread(target=parse, daemon=True)
  worker.start()
  worker.join(120)
  assert outcome, "the parser ran for 120 s on one state of at most MAX_STATE_BYTES"
  assert isinstance(outcome[0], InvalidRequestError), repr(outcome[0])
