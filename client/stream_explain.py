"""What one step of a stream of N sub-streams held, merged from its parts.

Global batch k of a stream of N sub-streams (server/data/streams/sub_streams.py)
is sub-batch k of each, one after another, and each sub-stream continues
from its own position; so a server explains one sub-stream's sub-batch
(server/data/provenance.py explain_stream), and this host's explanation is
asked of each sub-stream it has rows of (contract.sub_stream_rows), at once
(they may go to several servers), and their rows put one after another:
this host's slice in order, each row naming its sub-stream.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Sequence

from grain_elevator.client.backend import Backend
from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import InternalError, InvalidRequestError


def explain(backend: Backend, spec: ReadSpec, step: int, positions: Sequence[str]
            ) -> dict[str, Any]:
  """This host's rows of global batch `step` of the stream `spec` reads
  (described, of N > 1 sub-streams), `positions` being where each
  sub-stream's sub-batch `step` starts: docs/client.md ("What a step held")."""
  info = spec.require_info()
  n, g = info.stream_shards, spec.global_batch_size
  h, hosts = spec.shard_index, spec.shard_count
  mine = [j for j in range(n) if len(contract.sub_stream_rows(g, h, hosts, j, n))]
  parts = _explained(backend, spec, step, positions, mine)
  if all(p["stream_ended"] for p in parts.values()):
    # Evaluation mode: this host's sub-streams have ended, and the step is
    # there while any other has a batch (their padding rows are this host's).
    parts.update(_explained(backend, spec, step, positions,
                            [j for j in range(n) if j not in parts]))
    if all(p["stream_ended"] for p in parts.values()):
      raise InvalidRequestError(f"{spec}: the stream ends before step {step} (each of its "
                                f"{n} sub-streams has ended)")
  rows = [row for j in mine for row in parts[j]["rows"]]
  want = len(contract.host_rows(g, h, hosts))
  if [row.get("row") for row in rows] != list(range(want)):
    raise InternalError(f"{spec}: the explanations of step {step}'s sub-streams do not "
                        f"hold this host's {want} rows in order")
  leaves = [p["traced_leaf"] for p in parts.values() if p["traced_leaf"] is not None]
  first = parts[mine[0]]
  return {
      "version": first["version"], "dataset": first["dataset"],
      "config_fingerprint": info.config_fingerprint, "kind": "stream", "step": step,
      "global_batch_size": g, "shard_index": h, "shard_count": hosts, "stream_shards": n,
      "stream_state": [parts[j]["stream_state"] if j in parts else positions[j]
                       for j in range(n)],
      "traced_leaf": leaves[0] if leaves else None, "rows": rows}


def _explained(backend: Backend, spec: ReadSpec, step: int, positions: Sequence[str],
               shards: list[int]) -> dict[int, dict[str, Any]]:
  """Each of sub-streams `shards`' explanation of its sub-batch `step`,
  asked at once, checked to answer for it."""
  def one(j: int) -> dict[str, Any]:
    part = backend.explain(pb.ExplainRequest(request=spec.request(
        step, 1, stream_state=positions[j], stream_shard=j)))
    if (part.get("stream_shard") != j or part.get("step") != step
        or not isinstance(part.get("stream_ended"), bool)):
      raise InternalError(f"{spec}: an explanation of sub-stream {j}'s step {step} answered "
                          f"for sub-stream {part.get('stream_shard')!r} step "
                          f"{part.get('step')!r}")
    return part

  if len(shards) <= 1:
    return {j: one(j) for j in shards}
  with concurrent.futures.ThreadPoolExecutor(len(shards)) as pool:
    return dict(zip(shards, pool.map(one, shards)))
