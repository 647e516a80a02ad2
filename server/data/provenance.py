"""What a step held: where each row of a host's slice came from (`elevator explain`).

Every row of a 1:1 dataset or a mixture is a pure function of the config,
G, the step and the host (the contract, proto/contract.py), so its origin is
computed, not logged: the record position in the dataset's stream, its
epoch, the source record behind it (after the shuffle) and the shard and
record index where that is stored; for a mixture also the component and the
position in the component's stream; in evaluation mode, rows past the
stream's end are marked as padding. The JSON this returns is documented in
docs/client.md ("What a step held"); EXPLAIN_VERSION numbers its format.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto.errors import InvalidRequestError
from grain_elevator.proto.limits import MAX_EXPLAIN_ROWS

EXPLAIN_VERSION = 1


def explain(ds: Any, step: int, global_batch_size: int, shard_index: int, shard_count: int,
            record_offset: int = 0) -> dict[str, Any]:
  """The rows of host h of H's slice of global batch `step`, each with its
  origin (a JSON-safe dict). `ds`: an ElevatorDataset or a MixtureDataset,
  the steps already validated by the request path."""
  info = ds.info
  rows = global_batch_size // shard_count
  if rows > MAX_EXPLAIN_ROWS:
    raise InvalidRequestError(
        f"dataset {info.name!r}: a host slice of {rows} rows is more than one explanation "
        f"holds ({MAX_EXPLAIN_ROWS}, MAX_EXPLAIN_ROWS); explain it in parts with more hosts "
        f"(--hosts {-(-global_batch_size // MAX_EXPLAIN_ROWS)} or more, each a --host)")
  positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                      record_offset)
  first_row = contract.host_rows(global_batch_size, shard_index, shard_count).start
  real = [p for p in positions if p < info.stream_length]
  components = getattr(ds, "components", None)
  origins = (_mixture_origins(ds, real, global_batch_size) if components is not None
             else ds.origins(real))
  out_rows: list[dict[str, Any]] = []
  for i, p in enumerate(positions):
    row: dict[str, Any] = {"row": i, "global_row": first_row + i}
    if i < len(origins):
      row.update(origins[i])
    else:  # evaluation mode: past the stream's end, a zero row masked out
      row.update({"position": p, "padding": True})
    out_rows.append(row)
  return {
      "version": EXPLAIN_VERSION, "dataset": info.name,
      "config_fingerprint": info.config_fingerprint, "kind": (
          "mixture" if components is not None else "records"),
      "step": step, "global_batch_size": global_batch_size, "shard_index": shard_index,
      "shard_count": shard_count, "record_offset": record_offset, "rows": out_rows}


def _mixture_origins(ds: Any, positions: list[int], global_batch_size: int
                     ) -> list[dict[str, Any]]:
  """Each mixture position's component, its position in the component's
  stream, and that record's origin there."""
  if not positions:
    return []
  component, index = ds.locate(np.asarray(positions, np.int64), global_batch_size)
  out: list[dict[str, Any]] = [{} for _ in positions]
  for j, name in enumerate(ds.names):
    where = np.flatnonzero(component == j)
    if not len(where):
      continue
    for i, origin in zip(where.tolist(), ds.components[j].origins(index[where].tolist())):
      q = origin.pop("position")
      out[i] = {"position": positions[i], "component": name, "component_position": q,
                **origin}
  return out
