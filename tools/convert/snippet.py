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
  comment lines for the top of the table, a comment per feature and per
  option, and for stream datasets the `iter_pipeline` and its
  `iter_options`."""

  pipeline: str | None = None
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  comments: tuple[str, ...] = ()
  feature_comments: dict[str, str] = dataclasses.field(default_factory=dict)
  iter_pipeline: str | None = None
  iter_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  option_comments: dict[str, str] = dataclasses.field(default_factory=dict)


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
  if serving.iter_pipeline:
    lines.append(f"iter_pipeline = {value(serving.iter_pipeline)}")
  plain = {k: v for k, v in serving.options.items() if k != "features"}
  if plain:
    lines.append(f"[{table}.options]")
    lines += [_line(k, v, serving.option_comments.get(k)) for k, v in plain.items()]
  features = serving.options.get("features")
  if features is not None:
    lines.append(f"[{table}.options.features]")
    lines += [_line(k, v, serving.feature_comments.get(k)) for k, v in features.items()]
  if serving.iter_options:
    lines.append(f"[{table}.iter_options]")
    lines += [_line(k, v, None) for k, v in serving.iter_options.items()]
  return "\n".join(lines) + "\n"


def _line(k: str, v: Any, comment: str | None) -> str:
  """`key = value`, with a trailing comment if there is one."""
  return f"{key(k)} = {value(v)}" + (f"  # {comment}" if comment else "")
