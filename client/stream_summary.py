"""Counts per source over a range of a stream dataset's steps.

A stream's rows are made by its pipeline from a position, so a summary
traces every step (server/data/provenance.py), and a server traces at most
MAX_STREAM_SUMMARY_ROWS rows a call, within a request's deadline. A range
is asked for in such calls, each from the position where the last ended
(its `next_stream_state`), and the counts added up here.

A stream of N sub-streams (server/data/streams/sub_streams.py) is N such
ranges, one per sub-stream, of its sub-batches (G/N rows a step), each
from its own position: asked for a round of calls at a time, the N calls
of a round at once (they may go to N servers), and all added up.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

from grain_elevator.client.backend import Backend
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import EndOfDataError, InternalError
from grain_elevator.proto import limits

_SUMMED = ("rows", "padding_rows", "tokens")
_PER_SOURCE = ("tokens", "segments", "documents")


def summarize(backend: Backend, spec: ReadSpec, start: int, end: int,
              positions: Sequence[str],
              progress: Callable[[int], None] | None = None) -> dict[str, Any]:
  """Steps [start, end) of the stream `spec` reads (described), `positions`
  being where `start` begins in each sub-stream (one for a stream of one):
  the servers' calls, merged; `progress(steps)` after each call (each
  round of N calls)."""
  n = spec.require_info().stream_shards
  several = n > 1
  positions = list(positions)
  per_call = limits.stream_summary_steps(spec.global_batch_size // n)
  rounds: list[list[dict[str, Any]]] = []
  step = start
  pool = concurrent.futures.ThreadPoolExecutor(n) if several else None
  try:
    while step < end:
      k = min(per_call, end - step)
      call = lambda j, step=step, k=k: _call(backend, spec, step, k, positions[j], j, several)
      parts = list(pool.map(call, range(n))) if pool is not None else [call(0)]
      if several and not spec.require_info().drop_remainder:  # evaluation mode
        made = max(p["steps_made"] for p in parts)
        if made < k:
          raise EndOfDataError(
              f"{spec}: a summary of steps [{start}, {end}) passes the end of the stream "
              f"(every sub-stream's), which ends after step {step + made - 1}")
      positions = [p["next_stream_state"] for p in parts]
      rounds.append(parts)
      step += k
      if progress is not None:
        progress(k)
  finally:
    if pool is not None:
      pool.shutdown()
  if not several:
    return merge([parts[0] for parts in rounds])
  return merge_sub_streams([merge([parts[j] for parts in rounds]) for j in range(n)],
                           spec.require_info().config_fingerprint)


def _call(backend: Backend, spec: ReadSpec, step: int, k: int, position: str, shard: int,
          several: bool) -> dict[str, Any]:
  """One server call: steps [step, step + k) of sub-stream `shard` (of the
  stream, for one), checked to answer for them."""
  part = backend.explain(pb.ExplainRequest(summary=True, request=spec.request(
      step, k, stream_state=position, whole=True, stream_shard=shard)))
  after = part.get("next_stream_state")
  if part.get("steps") != [step, step + k] or not isinstance(after, str):
    raise InternalError(f"a stream summary of steps [{step}, {step + k}) answered for "
                        f"{part.get('steps')!r}")
  if several and (part.get("stream_shard") != shard
                  or not isinstance(part.get("steps_made"), int)):
    raise InternalError(f"a stream summary of sub-stream {shard} answered for sub-stream "
                        f"{part.get('stream_shard')!r}")
  return part


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
  """Consecutive calls' summaries as one: counts added, shares of the whole."""
  out = {**parts[0], "steps": [parts[0]["steps"][0], parts[-1]["steps"][1]],
         "next_stream_state": parts[-1]["next_stream_state"]}
  out.pop("steps_made", None)  # a sub-stream call's: said by the counts merged
  return _added(out, parts)


def merge_sub_streams(parts: list[dict[str, Any]], fingerprint: str) -> dict[str, Any]:
  """The N sub-streams' summaries of one range (each merged) as the
  stream's: counts added, each one's positions listed in order, the
  dataset's own `fingerprint` (the parts name their sub-streams')."""
  first = parts[0]
  out = {key: value for key, value in first.items() if key != "stream_shard"}
  out.update(config_fingerprint=fingerprint, stream_state=[p["stream_state"] for p in parts],
             next_stream_state=[p["next_stream_state"] for p in parts])
  return _added(out, parts)


def _added(out: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
  """`out` with the counts of `parts` added up, shares of the whole."""
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
