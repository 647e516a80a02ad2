"""Embedded mode: the server's own request path, run in the trainer's process.

Same contract, same validation, same batch assembly, no network:
bit-identical to the service, which makes it both the zero-set-up path and
the tests' oracle. The serving engine is imported here, when a `local:`
target is first used, and nowhere else on the client side.
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any


from grain_elevator.client.transport import targets as targets_lib
from grain_elevator.client.window import EMBEDDED_REQUESTS
from grain_elevator.client.transport.connection import Step
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import Cancelled
from grain_elevator.proto.spec import DatasetInfo


class EmbeddedBackend:
  """Serves a config's datasets in-process, opening each on first use."""

  uses_bulk = False
  times_steps = False  # fetch threads run the pipeline: requests sized by bytes
  retries = fallbacks = 0
  parallelism = EMBEDDED_REQUESTS  # no server workers: fetch threads run the pipeline here

  def __init__(self, config_path: str):
    # pylint: disable=g-import-not-at-top
    from grain_elevator.server.data import config as config_lib
    from grain_elevator.server.data import registry
    from grain_elevator.server.serving import request_path
    self.config_path = config_path
    self.targets = [targets_lib.local_target(config_path)]
    config = config_lib.load_config(config_path)
    self._path = request_path.RequestPath(registry.Datasets(config, open_now=False))
    self._turns = threading.Lock()  # sub-streams' steps, one at a time (`fetch`)

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    with self._path.admitted(None) as ticket:
      return self._path.describe(ticket, pb.DescribeRequest(
          dataset=dataset, global_batch_size=global_batch_size))

  def fetch(self, request: pb.BatchRequest, token: Any = None,
            out: list[Step] | None = None) -> list[Step]:
    """Like ConnectionPool.fetch: steps appended to `out` as they are made."""
    out = [] if out is None else out
    cancelled = (lambda: token.cancelled) if token is not None else (lambda: False)
    # Sub-streams' fetch threads make one step at a time: N pipelines in
    # turns under the GIL cost about the CPU of one, at once ~1.7x it.
    turns = self._turns if request.stream_shards > 1 else contextlib.nullcontext()
    with self._path.admitted(None) as ticket:
      steps = self._path.steps(ticket, request, lambda: not cancelled())
      while True:
        with turns:
          got = next(steps, None)
        if got is None:
          break
        _, leaves, state = got
        out.append(Step(leaves, state))
    if cancelled():
      raise Cancelled(f"dataset {request.dataset!r}: cancelled")
    return out

  def skip(self, request: pb.BatchRequest, token: Any = None) -> pb.SkipResponse:
    """Like ConnectionPool.skip: the position after the request's steps."""
    cancelled = (lambda: token.cancelled) if token is not None else (lambda: False)
    with self._path.admitted(None) as ticket:
      answer = self._path.skip(ticket, request, lambda: not cancelled())
    return answer

  def explain(self, request: pb.ExplainRequest) -> dict[str, Any]:
    """Like ConnectionPool.explain: what one step held."""
    with self._path.admitted(None) as ticket:
      return json.loads(self._path.explain(ticket, request).json)

  def close(self) -> None:
    pass
