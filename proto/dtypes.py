"""Dtype names as they travel: the one codec for every place a dtype is
written as text (Batch tensors, element specs, the converter's features
specs in a config).

A name where numpy's name round-trips ("float32", "datetime64[ns]"), else
numpy's code with its byte order ("|S64", "<U8"). Text from a peer is matched
against that grammar before numpy sees it: `np.dtype` parses comma-separated
text with `ast.literal_eval`. Imports only numpy, so the converter's Beam
environment uses it too.
"""

from __future__ import annotations

import functools
import re

import numpy as np


@functools.lru_cache(maxsize=256)
def dtype_to_str(dtype: np.dtype) -> str:
  """A portable dtype name: "float32", "uint8"; numpy's code ("|S64") where a
  name would not round-trip (fixed-size bytes and strings)."""
  try:
    if np.dtype(dtype.name) == dtype:
      return dtype.name
  except TypeError:
    pass
  return dtype.newbyteorder("<").str if dtype.byteorder not in "|" else dtype.str


# What dtype_to_str writes: a name ("float32", "datetime64[ns]") or numpy's
# code for fixed-size bytes and strings ("|S64", "<U8"). Anything else is refused before numpy
# sees it: np.dtype parses comma-separated text with ast.literal_eval.
_DTYPE_TEXT = re.compile(r"[<>|=]?[A-Za-z][A-Za-z0-9]{0,15}(\[[A-Za-z0-9]{1,8}\])?")


def dtype_from_str(text: str) -> np.dtype:
  """The dtype a peer named; ValueError for anything dtype_to_str does not write."""
  if not _DTYPE_TEXT.fullmatch(text):
    raise ValueError(f"{text[:40]!r} is not a dtype name")
  try:
    return np.dtype(text).newbyteorder("<")
  except (TypeError, ValueError, SyntaxError) as e:
    raise ValueError(f"{text!r} is not a numpy dtype: {e}") from None
