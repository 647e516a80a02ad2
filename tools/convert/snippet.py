"""The TOML that serves a converted dataset: printed by `elevator convert`
and written as OUT_DIR/elevator.toml.

The rendering is deterministic (same input, same text), so the local and the
Beam converter write identical files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclasses.dataclass(frozen=True)
class Serving:
  """How to serve what a converter wrote: the `pipeline` and its `options`
  (a `features` option renders as a table of its own, one feature a line),
  comment lines for the top of the table, and a comment per feature."""

  pipeline: str | None = None
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  comments: tuple[str, ...] = ()
  feature_comments: dict[str, str] = dataclasses.field(default_factory=dict)


def key(name: str) -> str:
  """A TOML key: bare where it can be, quoted otherwise."""
  return name if _BARE_KEY.fullmatch(name) else value(name)


def value(v: Any) -> str:
  """A TOML value (inline tables for dicts)."""
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, int):
    return str(v)
  if isinstance(v, float):
    if math.isnan(v):
      return "nan"
    if math.isinf(v):
      return "inf" if v > 0 else "-inf"
    return repr(v)
  if isinstance(v, str):
    return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
  if isinstance(v, (list, tuple)):
    return "[" + ", ".join(value(x) for x in v) + "]"
  if isinstance(v, dict):
    if not v:
      return "{}"
    return "{ " + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + " }"
  raise TypeError(f"no TOML form for {v!r}")


def render(name: str, paths: list[str], serving: Serving,
           header: tuple[str, ...] = ()) -> str:
  """The `[datasets.NAME]` table (and its options) as TOML text."""
  table = f"datasets.{key(name)}"
  lines = [f"# {c}" if c else "#" for c in header]
  lines += [f"# {c}" if c else "#" for c in serving.comments]
  lines.append(f"[{table}]")
  lines.append(f"paths = {value(paths)}")
  if serving.pipeline:
    lines.append(f"pipeline = {value(serving.pipeline)}")
  plain = {k: v for k, v in serving.options.items() if k != "features"}
  if plain:
    lines.append(f"[{table}.options]")
    lines += [f"{key(k)} = {value(v)}" for k, v in plain.items()]
  features = serving.options.get("features")
  if features is not None:
    lines.append(f"[{table}.options.features]")
    for k, v in features.items():
      comment = serving.feature_comments.get(k)
      lines.append(f"{key(k)} = {value(v)}" + (f"  # {comment}" if comment else ""))
  return "\n".join(lines) + "\n"
