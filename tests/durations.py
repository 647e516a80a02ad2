"""The seconds each test file took in a whole run, for the order a parallel
run starts them in: longest first, so it does not end waiting on a long file
started last (tests/conftest.py). Recorded in tests/durations.json by

    make durations    # python tests/durations.py JUNIT_XML > tests/durations.json
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

RECORDED = pathlib.Path(__file__).with_name("durations.json")


def load() -> dict[str, float]:
  """{test file relative to the checkout: seconds}; {} if none is recorded."""
  try:
    return json.loads(RECORDED.read_text())
  except FileNotFoundError:
    return {}


def from_junit(path: str) -> dict[str, float]:
  """Seconds per test file (set-up, call and tear-down) in pytest's JUnit XML."""
  seconds: collections.Counter[str] = collections.Counter()
  for case in ET.parse(path).iter("testcase"):
    module = case.get("classname", "").split("::")[0]
    # classname is the module's dotted path, then any class's name.
    parts = module.split(".")
    while parts and not pathlib.Path(*parts).with_suffix(".py").exists():
      parts.pop()
    if parts:
      seconds[str(pathlib.Path(*parts).with_suffix(".py"))] += float(case.get("time", 0))
  return {name: round(s, 1) for name, s in seconds.most_common()}


if __name__ == "__main__":
  json.dump(from_junit(sys.argv[1]), sys.stdout, indent=0)
  sys.stdout.write("\n")
