"""Counts per source over a range of a stream dataset's steps.

A stream's rows are made by its pipeline from a position, so a summary
traces every step (server/data/provenance.py), and a server traces at most
MAX_STREAM_SUMMARY_ROWS rows a call, within a request's deadline. A range
is asked for in such calls, each from the position where the last ended
(its `next_stream_state`), and the counts added up here.
"""

from __future__ import annotations

from typing import Any, Callable

from grain_elevator.client.backend import Backend
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import InternalError
from grain_elevator.proto import limits

_SUMMED = ("rows", "padding_rows", "tokens")
_PER_SOURCE = ("tokens", "segments", "documents")


def summarize(backend: Backend, spec: ReadSpec, start: int, end: int, position: str,
              progress: Callable[[int], None] | None = None) -> dict[str, Any]:
  """Steps [start, end) of the stream `spec` reads (described), `position`
  being where `start` begins: the servers' calls, merged; `progress(steps)`
  after each call."""
  per_call = limits.stream_summary_steps(spec.global_batch_size)
  parts = []
  step = start
  while step < end:
    n = min(per_call, end - step)
    part = backend.explain(pb.ExplainRequest(summary=True, request=spec.request(
        step, n, stream_state=position, whole=True)))
    position = part.get("next_stream_state")
    if part.get("steps") != [step, step + n] or not isinstance(position, str):
      raise InternalError(f"a stream summary of steps [{step}, {step + n}) answered for "
                          f"{part.get('steps')!r}")
    parts.append(part)
    step += n
    if progress is not None:
      progress(n)
  return merge(parts)


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
  """Consecutive calls' summaries as one: counts added, shares of the whole."""
  out = {**parts[0], "steps": [parts[0]["steps"][0], parts[-1]["steps"][1]],
         "next_stream_state": parts[-1]["next_stream_state"]}
  for key in _SUMMED:
    out[key] = sum(p[key] for p in parts)
  sources: dict[str, dict[str, Any]] = {}
  for part in parts:
    for name, counts in part["components"].items():
      into = sources.setdefault(name, dict.fromkeys(_PER_SOURCE, 0))
      for key in _PER_SOURCE:
        into[key] += counts[key]
  total = out["tokens"]
  out["components"] = {name: {**c, "share": c["tokens"] / total if total else 0.0}
                       for name, c in sources.items()}
  return out
