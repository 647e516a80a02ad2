"""Element structure: flattening a record's pytree into leaves and back.

A record is a nest of dicts (string keys), lists and tuples with numpy arrays
or scalars as leaves. The structure travels as JSON (`ElementSpec.structure`),
so any language can rebuild it; dict keys are visited in sorted order, as JAX
and Grain do.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

Structure = Any  # int leaf index, or {"dict"|"list"|"tuple": ...}


def flatten(tree: Any) -> tuple[list[Any], Structure, list[str]]:
  """Returns (leaves, structure, leaf paths) of `tree`."""
  leaves: list[Any] = []
  paths: list[str] = []

  def visit(node: Any, path: tuple[str, ...]) -> Structure:
    if isinstance(node, dict):
      for key in node:
        if not isinstance(key, str):
          raise TypeError(
              f"dict keys must be strings, got {key!r} at {'/'.join(path) or '<root>'}"
          )
      return {"dict": {k: visit(node[k], path + (k,)) for k in sorted(node)}}
    if isinstance(node, (list, tuple)):
      kind = "tuple" if isinstance(node, tuple) else "list"
      return {kind: [visit(v, path + (str(i),)) for i, v in enumerate(node)]}
    leaves.append(node)
    paths.append("/".join(path))
    return len(leaves) - 1

  structure = visit(tree, ())
  return leaves, structure, paths


def unflatten(structure: Structure, leaves: list[Any]) -> Any:
  """Inverse of `flatten`: rebuilds the nest with `leaves` in leaf order."""
  if isinstance(structure, int):
    return leaves[structure]
  ((kind, body),) = structure.items()
  if kind == "dict":
    return {k: unflatten(v, leaves) for k, v in body.items()}
  items = [unflatten(v, leaves) for v in body]
  return tuple(items) if kind == "tuple" else items


def structure_to_json(structure: Structure) -> str:
  return json.dumps(structure, sort_keys=True, separators=(",", ":"))


def structure_from_json(text: str) -> Structure:
  return json.loads(text)


def as_array(leaf: Any) -> np.ndarray:
  """A leaf as a numpy array (Python scalars become 0-d arrays)."""
  return leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
