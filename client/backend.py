"""What an iterator reads from: a pool of connections to servers, or the
serving engine in-process (embedded mode). Both answer the same two
questions, so `RemoteDataset` is written once for either."""

from __future__ import annotations

from typing import Any, Protocol, Sequence


from grain_elevator.client.transport import targets as targets_lib
from grain_elevator.client.transport.connection import Step
from grain_elevator.client.transport.host_memory import HostMemory
from grain_elevator.client.transport.options import (WINDOW_BYTES, RetryPolicy, Security,
                                                     TransportOptions)
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.spec import DatasetInfo


class Backend(Protocol):
  """A source of steps: `ConnectionPool` (client/transport/pool.py) or
  `EmbeddedBackend` (client/embedded.py)."""

  targets: list[str]
  uses_bulk: bool  # whether batches travel over the bulk transport
  retries: int  # attempts tried again (client/stats.py)
  fallbacks: int  # requests and ports moved from bulk to gRPC
  # Requests in flight that keep the servers busy, once `describe` was
  # given a global batch size (client/window.py sizes the window from it).
  parallelism: int
  # Whether a step can say how long a server worker took to make it, by
  # which requests are sized (client/request_size.py): not in embedded mode.
  times_steps: bool

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    """What is offered; with a global batch size, also ready to fetch it."""

  def fetch(self, request: pb.BatchRequest, token: Any,
            out: list[Step] | None = None) -> list[Step]:
    """The steps of `request`, in order, each appended to `out` as it arrives."""

  def skip(self, request: pb.BatchRequest, token: Any) -> pb.SkipResponse:
    """A stream dataset's position after the steps of `request` (at most
    limits.skip_steps(G)), none of them sent, and whether its sub-stream
    ended on the way (evaluation mode: SkipResponse.stream_ended)."""

  def explain(self, request: pb.ExplainRequest) -> dict[str, Any]:
    """Where each row of one step came from, or a summary of steps
    (server/data/provenance.py)."""

  def close(self) -> None:
    """Ends every request and connection."""


def make_backend(target: str | Sequence[str], *,
                 transport: TransportOptions = TransportOptions(),
                 retry: RetryPolicy = RetryPolicy(), security: Security = Security(),
                 host_memory: HostMemory | None = None,
                 window_bytes: int = WINDOW_BYTES) -> Backend:
  """A ConnectionPool for server targets, or an EmbeddedBackend for
  "local:CONFIG_PATH" (client/transport/targets.py). `host_memory`: where
  the bulk transport receives batches (None: ordinary memory); embedded
  mode's batches are the pipeline's own arrays. `window_bytes`: the most
  its iterator keeps in flight (client/window.py)."""
  targets = targets_lib.parse_targets(target)
  config = targets_lib.local_config(targets)
  if config is not None:
    from grain_elevator.client.embedded import EmbeddedBackend  # pylint: disable=g-import-not-at-top
    return EmbeddedBackend(config)
  from grain_elevator.client.transport.pool import ConnectionPool  # pylint: disable=g-import-not-at-top
  return ConnectionPool(targets, transport=transport, retry=retry, security=security,
                        host_memory=host_memory, window_bytes=window_bytes)
