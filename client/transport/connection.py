"""What the pool sees of a connection: one interface, its errors, a step's checks.

A `Connection` streams the steps of one request and fails with a
`TransportError` carrying the status the server (or the network) gave. The
pool (pool.py) sees nothing else, so retry, backoff, shunning and fallback
are written once for both transports: grpc_connection.py and
bulk_connection.py.

Nothing a server sends is trusted: every message's size is bounded before
it is allocated, and every step is checked against the element spec
(`decode_step`) before the trainer sees it. A reply that breaks either is
a `BadReplyError`, which the pool retries on another replica.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterator, Protocol, Sequence

import grpc
import numpy as np

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import positions
from grain_elevator.proto import wire
from grain_elevator.proto.spec import LeafSpec



@dataclasses.dataclass
class Step:
  """One step as it arrived: its leaves; for a stream dataset the position
  after it (the stream_state a request for the next step names); and the
  seconds a server worker takes to make such a step, where the request
  asked (0: not said; client/request_size.py sizes requests by it)."""

  leaves: list[np.ndarray]
  next_stream_state: str = ""
  production_s: float = 0.0


# What a connection yields per step: (step, leaves, next_stream_state,
# production_us).
Steps = Iterator[tuple[int, list[np.ndarray], str, int]]
# The longest Describe answer a client accepts (a few KiB is usual), and the
# limit on batches of a channel opened before any element spec is known.
MAX_CONTROL_MESSAGE_BYTES = 4 << 20


class TransportError(Exception):
  """A failed request or connection, with the status it ended in.

  The pool notes where it happened (`replica`, `over_bulk`), so that the
  retry can go somewhere else."""

  replica: tuple[str, str] | None = None  # (target, host) of the connection
  over_bulk: bool = False

  def __init__(self, code: grpc.StatusCode, details: str, error_type: str = ""):
    super().__init__(f"{code.name}: {details}")
    self.code, self.details, self.error_type = code, details, error_type

  def to_error(self) -> errors.ElevatorError:
    """The typed error a trainer sees for it."""
    return errors.from_status(self.code, self.details, self.error_type)


class BadReplyError(TransportError):
  """A server's reply that breaks the element spec, the size bounds or the
  protocol. The replica is at fault (a bug, a bad build, corrupted memory,
  an impostor), not the data: the pool asks another replica, and raises
  DataLossError only if every replica does the same."""

  def __init__(self, details: str):
    super().__init__(grpc.StatusCode.DATA_LOSS, details, errors.DataLossError.__name__)


def decode_step(payload: Any, request: pb.BatchRequest, index: int, max_bytes: int,
                expect: Sequence[LeafSpec] | None, server: str, *,
                positions_of: str | None = None) -> tuple[int, list[np.ndarray], str, int]:
  """Step `index` of `request` from a received Batch, checked against its
  size bound, `expect` (the leaves the spec gives it) and the step it must
  be; for a stream dataset (`positions_of`: its first position), the
  position after it must be one of its stream's (proto/positions.py): an
  empty one would restart the stream, a foreign one break it. `server`
  names the sender and its transport for the error. The encoder's own
  bytes are recognised whole (wire.BatchLayout); anything else is parsed."""
  step = request.start_step + index
  if len(payload) > max_bytes:
    raise BadReplyError(
        f"{server} sent {len(payload)} bytes for dataset {request.dataset!r} step {step}, "
        f"over the {max_bytes} its element spec allows")
  if expect is not None and request.compression == wire.COMPRESSION_NONE:
    exact = wire.layout_of(tuple(expect)).decode(payload, step)  # the encoder's bytes
    if exact is not None:
      check_position(exact[1], request, step, server, positions_of)
      return step, *exact
  try:
    got, leaves, state, production_us = wire.decode_batch_message(payload, expect)
  except wire.BadBatchError as e:
    raise BadReplyError(f"{server} sent a bad batch for dataset {request.dataset!r} "
                        f"step {step}: {e}") from None
  if got != step:
    raise BadReplyError(f"{server} sent step {got} for dataset {request.dataset!r} "
                        f"step {step}")
  check_position(state, request, step, server, positions_of)
  return got, leaves, state, production_us


def check_position(state: str, request: pb.BatchRequest, step: int, server: str,
                   positions_of: str | None) -> None:
  """For a stream dataset (`positions_of`: its first position), the position
  after `step` must be one of its stream's (proto/positions.py): an empty
  one would restart the stream, a foreign one break it."""
  if positions_of is None:
    return
  if not state:
    raise BadReplyError(f"{server} sent no stream position with dataset "
                        f"{request.dataset!r} step {step}")
  try:
    positions.parse(state, positions_of)
  except positions.BadPosition as e:
    raise BadReplyError(f"{server} sent dataset {request.dataset!r} step {step} with a "
                        f"stream position not of its stream: {e}") from None


class CancelToken:
  """Lets another thread cancel one fetch, including its request in flight."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._cancelled = False
    self._call: Any = None

  @property
  def cancelled(self) -> bool:
    return self._cancelled

  def attach(self, call: Any) -> None:
    """`call`: what `cancel()` must interrupt (a gRPC call, a bulk connection)."""
    with self._lock:
      self._call = call
      if self._cancelled and call is not None:
        call.cancel()

  def cancel(self) -> None:
    with self._lock:
      self._cancelled = True
      if self._call is not None:
        self._call.cancel()


class Connection(Protocol):
  """One TCP connection to one worker of one replica."""

  target: str  # as the user gave it
  host: str  # the replica's address behind the target
  server: pb.ServerInfo  # the worker that took the connection
  capacity: int  # requests it carries at once
  broken: bool  # must be reopened before its next request

  def stream(self, request: pb.BatchRequest, *, timeout_s: float, token: CancelToken,
             max_frame_bytes: int, expect: Sequence[LeafSpec] | None = None,
             positions_of: str | None = None) -> Steps:
    """(step, leaves, next_stream_state, production_us) for each step of
    `request`, in order; TransportError on failure. `timeout_s` bounds the
    request (bulk: each wait for data). A step message over
    `max_frame_bytes`, or whose leaves are not those `expect` gives, or (a
    stream's) whose position is not one of those `positions_of` has, is a
    BadReplyError before it is decoded; what is allocated before that check
    is bounded too (bulk: by the frame header, gRPC: by the channel's
    limits)."""

  def close(self) -> None: ...
