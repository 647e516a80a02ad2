"""The jsonl line check (tools/convert/json_check.py): the walk that never
builds a line's values accepts and refuses exactly what json.loads does, and
counts values exactly."""

from __future__ import annotations

import json
import random

import pytest

from grain_elevator.tools.convert import json_check

FIELD = "text"


def _oracle(text: str) -> object:
  """What json.loads makes of a line: its kinds, or the kind of error."""
  try:
    obj = json.loads(text)
  except RecursionError:
    return "too deep"
  except json.JSONDecodeError:
    return "not JSON"
  except ValueError:
    return "unreadable"
  field = json_check.kind_of(obj[FIELD]) if isinstance(obj, dict) and FIELD in obj else None
  return json_check.kind_of(obj), field


def _walked(text: str) -> object:
  try:
    return json_check.walk(text, FIELD, 1 << 40)
  except json_check.TooDeep:
    return "too deep"
  except json.JSONDecodeError:
    return "not JSON"
  except ValueError:
    return "unreadable"


CASES = [
    '{"text": "a"}', ' \t\r\n{"text": "a"} \r\n', '{}', '[]', '""', '0', '-0', '-0.5e-3',
    'null', 'true', 'false', 'NaN', 'Infinity', '-Infinity', '-Inf', '-', '1.', '.5', '01',
    '1e', '1e+', '1E+2', '[1,2,]', '[,1]', '{"a":1,}', '{,}', '{"a" 1}', '{"a":}', '{1:2}',
    '{"text": "a", "text": 3}', '{"text": 3, "text": "b"}', '{"x": {"text": "a"}}',
    '{"te\\u0078t": "a"}', '{"text": "\\ud800"}', '{"text": "\\uD83D\\uDE00"}',
    '{"text": "\\x"}', '{"text": "\\u12"}', '{"text": "tab\there"}', '{"text": "\x7f"}',
    '{"text": "a"} {"text": "b"}', '{"text": "a"}x', '{"text": "a"', '{"text": ["a"]}',
    '{"text": {"text": "a"}}', '{"text": "a", "n": [1, [2, [3, {"k": null}]]]}',
    '\ufeff{"text": "a"}', '{"text": "é😀"}', '{"text": "a"}\x00', '', ' ', '[', ']', '{',
    '"unterminated', '{"text": tru}', '{"text": nul}', '[1 2]', '{"a":1 "b":2}',
    '{"text": "a", "n": ' + "1" * 5000 + '}', '{"text": "a", "n": ' + "1" * 5000 + '.5}',
    '[' * 400 + ']' * 400, '[' * 400 + ']' * 399, '{"text": "a"}\u2028',
    '{"text": 1' + '0' * 400 + 'e-400}', '[1.5e999, -1e-999]',
    # Runs of simple members after a first one (read by one regex match):
    '[0, 1.5, -2e3, 1' + '2' * 150 + ']', '[0, 1' + '2' * 5000 + ']', '[1, 01]', '[1, 1.]',
    '[1, 1e]', '[1, 1.5.3]', '[1, -]', '[1, "a,b"]', '[1, "a\\"b"]', '[1, "tab\t"]',
    '[1, {} , [ ] ,{  }]', '[1,2}', '[1, 2 , 3 ]', '[1, truex]', '[1, nullnull]',
    '[1, NaN, -Infinity]', '[1, "a" "b"]', '[1, 2,]', '[[1, 2], [3, 4,], 5]',
    '{"x": {"a": 1, "b": 2 }, "text": "t"}', '{"x": {"a": 1, "text": 2}, "text": "t"}',
    '{"x": {"a": 1, "b" 2}, "text": "t"}', '{"x": {"a": 1, "b": 2,}, "text": "t"}',
    '{"x": {"a": 1, "b\\u0063": 2}, "text": "t"}', '{"text": "t", "x": [{}, {}, {"a": 1}]}',
]


@pytest.mark.parametrize("text", CASES)
def test_walk_agrees_with_json_loads(text):
  assert _walked(text) == _oracle(text)


def _random_value(rng: random.Random, depth: int) -> object:
  kind = rng.randrange(9 if depth < 4 else 6)
  if kind == 0:
    return rng.choice([None, True, False])
  if kind == 1:
    return rng.randint(-10**20, 10**20)
  if kind == 2:
    return rng.choice([0.5, -1e-300, 1e300, 3.0, float("nan"), float("inf")])
  if kind in (3, 4, 5):
    return "".join(rng.choice('ab"\\\n\té😀\x01/ ') for _ in range(rng.randrange(6)))
  if kind in (6, 7):
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(7))]
  return {rng.choice([FIELD, "x", "te\u00e9", "", "a,b"]): _random_value(rng, depth + 1)
          for _ in range(rng.randrange(7))}


def test_walk_agrees_with_json_loads_on_random_and_damaged_lines():
  rng = random.Random(33)
  noise = '{}[]",:0123456789eE.+-tfnaulsNIy \\/u\t\n\r\x00é'
  disagree = []
  for _ in range(4000):
    value = _random_value(rng, 0)
    if rng.random() < 0.7:
      value = {FIELD: value} if rng.random() < 0.5 else {"x": value, FIELD: "t"}
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, 1]), separators=rng.choice([None, (",", ":")]))
    for _ in range(rng.choice([0, 0, 1, 2])):  # damage it
      i = rng.randrange(len(text) + 1)
      cut = rng.randrange(3)
      text = text[:i] + "".join(rng.choice(noise) for _ in range(rng.randrange(3))) + \
          text[i + cut:]
    if _walked(text) != _oracle(text):
      disagree.append(text)
  assert not disagree, disagree[:5]


def test_values_are_counted_exactly():
  # 12 values: the object; "text" and "a"; "x", the array and its 3 items;
  # "y", its object, "z" and null.
  text = '{"text": "a", "x": [1, 2, {}], "y": {"z": null}}'
  assert json_check.walk(text, FIELD, 12) == ("an object", "a string")
  with pytest.raises(json_check.TooManyValues):
    json_check.walk(text, FIELD, 11)
  # A line no longer than the limit is parsed whole: it cannot hold more.
  assert json_check.check(text, FIELD, len(text)) == ("an object", "a string")
  with pytest.raises(json_check.TooManyValues):
    json_check.check(text, FIELD, 11)


def test_nesting_is_bounded():
  deep = "[" * (json_check.MAX_DEPTH + 1) + "]" * (json_check.MAX_DEPTH + 1)
  with pytest.raises(json_check.TooDeep):
    json_check.walk(deep, FIELD, 1 << 40)
  ok = "[" * json_check.MAX_DEPTH + "]" * json_check.MAX_DEPTH
  assert json_check.walk(ok, FIELD, 1 << 40) == ("an array", None)
