"""Batch assembly: stack each leaf of a list of records."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grain_elevator.proto import tree


class CollateError(ValueError):
  """A record does not match the dataset's element spec."""


def collate(rows: Sequence[Any], structure: tree.Structure,
            leaf_specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
  """Stacks `rows` into one array per leaf, checked against the spec.

  Every record must have the structure, dtypes and shapes of the spec (taken
  from record 0), so a batch is a fixed-shape array per leaf.
  """
  out = [np.empty((len(rows),) + shape, dtype) for _, dtype, shape in leaf_specs]
  for i, row in enumerate(rows):
    leaves, row_structure, _ = tree.flatten(row)
    if row_structure != structure:
      raise CollateError(
          f"row {i} has structure {tree.structure_to_json(row_structure)}, "
          f"expected {tree.structure_to_json(structure)}")
    for leaf, target, (path, dtype, shape) in zip(leaves, out, leaf_specs):
      leaf = tree.as_array(leaf)
      if leaf.shape != shape or leaf.dtype != dtype:
        raise CollateError(
            f"row {i}, leaf {path!r}: got {leaf.dtype}{list(leaf.shape)}, expected "
            f"{dtype}{list(shape)}; a pipeline must give every record the same "
            "dtypes and shapes")
      target[i] = leaf
  return out


def check_batch(leaves: Sequence[Any], structure: tree.Structure, num_rows: int,
                expected_structure: tree.Structure,
                leaf_specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
  """Checks an already-stacked batch (from a batch_transform) against the spec."""
  if structure != expected_structure:
    raise CollateError(
        f"batch_transform returned structure {tree.structure_to_json(structure)}, "
        f"expected {tree.structure_to_json(expected_structure)}")
  out = []
  for leaf, (path, dtype, shape) in zip(leaves, leaf_specs):
    leaf = np.ascontiguousarray(tree.as_array(leaf))
    if leaf.shape != (num_rows,) + shape or leaf.dtype != dtype:
      raise CollateError(
          f"batch_transform leaf {path!r}: got {leaf.dtype}{list(leaf.shape)}, "
          f"expected {dtype}{[num_rows, *shape]}")
    out.append(leaf)
  return out
