"""Batch assembly: stack each leaf of a list of records."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grain_elevator.proto import tree
from grain_elevator.proto.rows import MIN_ROW_BYTES, RowStack

Leaf = np.ndarray | RowStack


class CollateError(ValueError):
  """A record does not match the dataset's element spec."""


def collate(rows: Sequence[Any], structure: tree.Structure,
            leaf_specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]], *,
            stack: bool = True) -> list[Leaf]:
  """Stacks `rows` into one array per leaf, checked against the spec.

  Every record must have the structure, dtypes and shapes of the spec (taken
  from record 0), so a batch is a fixed-shape array per leaf. With
  `stack=False`, a leaf whose rows are each MIN_ROW_BYTES or more and
  C-contiguous is returned as a RowStack of them, for a socket to gather.
  """
  n = len(rows)
  gather = [not stack and n > 0 and dtype.itemsize * int(np.prod(shape)) >= MIN_ROW_BYTES
            for _, dtype, shape in leaf_specs]
  out: list[Any] = [None if g else np.empty((n,) + shape, dtype)
                    for g, (_, dtype, shape) in zip(gather, leaf_specs)]
  held: list[list[np.ndarray]] = [[] for _ in leaf_specs]
  for i, row in enumerate(rows):
    leaves, row_structure, _ = tree.flatten(row)
    if row_structure != structure:
      raise CollateError(
          f"row {i} has structure {tree.structure_to_json(row_structure)}, "
          f"expected {tree.structure_to_json(structure)}")
    for k, (leaf, (path, dtype, shape)) in enumerate(zip(leaves, leaf_specs)):
      leaf = tree.as_array(leaf)
      if leaf.shape != shape or leaf.dtype != dtype:
        raise CollateError(
            f"row {i}, leaf {path!r}: got {leaf.dtype}{list(leaf.shape)}, expected "
            f"{dtype}{list(shape)}; a pipeline must give every record the same "
            "dtypes and shapes")
      if gather[k]:
        if leaf.flags.c_contiguous:
          held[k].append(leaf)
          continue
        gather[k] = False  # a strided row: stack this leaf after all
        out[k] = np.empty((n,) + shape, dtype)
        for j, earlier in enumerate(held[k]):
          out[k][j] = earlier
      out[k][i] = leaf
  return [RowStack(h) if g else o for g, h, o in zip(gather, held, out)]


def check_batch(leaves: Sequence[Any], structure: tree.Structure, num_rows: int,
                expected_structure: tree.Structure,
                leaf_specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]], *,
                stack: bool = True) -> list[Leaf]:
  """Checks an already-stacked batch (from a batch_transform) against the
  spec. Its leaves may be RowStacks, which `stack=True` turns into arrays."""
  if structure != expected_structure:
    raise CollateError(
        f"batch_transform returned structure {tree.structure_to_json(structure)}, "
        f"expected {tree.structure_to_json(expected_structure)}")
  out = []
  for leaf, (path, dtype, shape) in zip(leaves, leaf_specs):
    if isinstance(leaf, RowStack):
      leaf = np.asarray(leaf) if stack else leaf
    else:
      leaf = np.ascontiguousarray(tree.as_array(leaf))
    if leaf.shape != (num_rows,) + shape or leaf.dtype != dtype:
      raise CollateError(
          f"batch_transform leaf {path!r}: got {leaf.dtype}{list(leaf.shape)}, "
          f"expected {dtype}{[num_rows, *shape]}")
    out.append(leaf)
  return out
