"""Byte ranges of an object as read requests: chunk extents coalesced.

A batch's reads (server/data/shards/object_reader.py, object_source.py) and
the read-ahead (read_ahead.py) cut their requests the same way, so a
planned read fetches exactly the ranges an unplanned one would.
"""

from __future__ import annotations

from typing import Sequence

# Chunks this close are fetched in one read: below a few KiB, one more
# request costs more than the bytes between them.
COALESCE_GAP_BYTES = 4 << 10
# One read's most bytes: bigger coalesced runs are split, so that their
# parts go out concurrently.
MAX_RANGE_BYTES = 16 << 20


def coalesce(extents: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted extents as read requests: neighbours that touch or lie within
  COALESCE_GAP_BYTES are one range, of at most MAX_RANGE_BYTES (an extent
  larger than that is a range of its own)."""
  out: list[list[int]] = []
  for begin, end in extents:
    if out and begin - out[-1][1] <= COALESCE_GAP_BYTES and end - out[-1][0] <= MAX_RANGE_BYTES:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([begin, end])
  return [(a, b) for a, b in out]
