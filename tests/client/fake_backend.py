"""An in-memory `Backend` (client/backend.py) for the client's unit tests, as
torchdata.nodes tests each node against a `MockSource`: no server, no
socket, no pipeline, so the iterators' own logic is what a test checks.

It serves one dataset, by step or as a stream, whose rows are a tiny
deterministic function of where they are:

- by step (a 1:1 dataset, not shuffled): row r of global batch k is record
  `record_offset + k*G + r`, as the contract has it (proto/contract.py);
- as a stream: each global batch starts at a position `{"at": p}` (JSON, as
  Grain's state is), holds `p, p+1, ...` times the batch's own stride, and
  the next batch starts at `p + G + p % 3`: positions are not arithmetic
  in the step, so an iterator must follow the ones it was sent.

Every request is checked against what the client must send, and kept
(`requests`), so a test can say what went on the wire. `Restartable` gives
Grain's checkpoint check (`grain.experimental.assert_equal_output_after_checkpoint`)
fresh iterators whose states are only ever JSON.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import grain
import numpy as np

from grain_elevator.client.read_spec import ReadSpec
from grain_elevator.client.transport.connection import Step
from grain_elevator.client.transport.options import (WINDOW_BYTES, RetryPolicy, Security,
                                                     TransportOptions)
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import Cancelled, EndOfDataError, InvalidRequestError
from grain_elevator.proto.spec import DatasetInfo, ElementSpec

FINGERPRINT = "fake0001"
SPEC = ElementSpec.of({"x": np.int64(0)})


def step_info(name: str = "steps", num_records: int = 64) -> DatasetInfo:
  """A finite 1:1 dataset of `num_records` records, one epoch, in order."""
  return DatasetInfo(name=name, num_records=num_records, num_epochs=1, shuffle=False, seed=0,
                     config_fingerprint=FINGERPRINT, element_spec=SPEC,
                     stream_length=num_records)


def stream_info(name: str = "stream") -> DatasetInfo:
  """A stream dataset whose first position is `{"at": 0}`."""
  return DatasetInfo(name=name, num_records=1000, num_epochs=1, shuffle=False, seed=0,
                     config_fingerprint=FINGERPRINT, element_spec=SPEC,
                     stream_length=1000, stream=True, stream_start=position(0))


def position(at: int) -> str:
  return contract.position_text({"at": at})


def read_spec(info: DatasetInfo, global_batch_size: int = 4, shard_index: int = 0,
              shard_count: int = 1, *, prefetch: int | None = None,
              transport: TransportOptions = TransportOptions()) -> ReadSpec:
  """What a host reads of `info`, described, with RemoteDataset's defaults."""
  return ReadSpec(targets=("fake:1",), dataset=info.name, global_batch_size=global_batch_size,
                  shard_index=shard_index, shard_count=shard_count, prefetch=prefetch,
                  window_bytes=WINDOW_BYTES, transport=transport, retry=RetryPolicy(),
                  security=Security(), stats_log_s=0.0).described(info)


def host_rows(values: np.ndarray, request: pb.BatchRequest) -> np.ndarray:
  """Host `shard_index`'s rows of a global batch (proto/contract.py)."""
  per_host = request.global_batch_size // request.shard_count
  return values[request.shard_index * per_host:(request.shard_index + 1) * per_host]


class FakeBackend:
  """Serves `info`'s steps from memory. `stream_end`: a stream's first
  position past its last batch (a batch starting there or later is the end,
  EndOfDataError, after the batches before it)."""

  uses_bulk = False
  times_steps = False  # its steps say nothing of their making: requests sized by bytes
  retries = fallbacks = 0

  def __init__(self, info: DatasetInfo, *, parallelism: int = 2, stream_end: int = 200):
    self.info = info
    self.targets = ["fake:1"]
    self.parallelism = parallelism
    self.stream_end = stream_end
    self.requests: list[pb.BatchRequest] = []  # fetches and skips, in the order sent
    self.explains: list[pb.ExplainRequest] = []
    self.closed = False
    self._lock = threading.Lock()

  # -- the dataset ----------------------------------------------------------

  def global_batch(self, step: int, global_batch_size: int, record_offset: int = 0,
                   at: int | None = None) -> tuple[np.ndarray, int | None]:
    """Global batch `step` (a stream's: the one starting at position `at`),
    and the position after it (None: by step)."""
    if at is None:
      start = record_offset + step * global_batch_size
      return np.arange(start, start + global_batch_size, dtype=np.int64), None
    stride = 1 + at % 2
    values = at + stride * np.arange(global_batch_size, dtype=np.int64)
    return values, at + global_batch_size + at % 3

  def _at(self, request: pb.BatchRequest) -> int:
    return json.loads(request.stream_state or self.info.stream_start)["at"]

  def _check(self, request: pb.BatchRequest) -> None:
    """What every request of this dataset must be (a server refuses the rest)."""
    assert request.dataset == self.info.name, request
    assert request.config_fingerprint == self.info.config_fingerprint, request
    assert request.global_batch_size % request.shard_count == 0, request
    assert 0 <= request.shard_index < request.shard_count, request
    assert request.num_steps >= 1, request
    if self.info.stream:
      assert request.record_offset == 0, request
    else:
      assert not request.stream_state, request
    with self._lock:
      assert not self.closed, "a request after close"

  # -- the Backend protocol -------------------------------------------------

  def describe(self, dataset: str = "", global_batch_size: int = 0) -> list[DatasetInfo]:
    return [self.info]

  def fetch(self, request: pb.BatchRequest, token: Any = None,
            out: list[Step] | None = None) -> list[Step]:
    self._check(request)
    with self._lock:
      self.requests.append(request)
    out = [] if out is None else out
    g = request.global_batch_size
    total = self.info.total_steps(g, request.record_offset)
    at = self._at(request) if self.info.stream else None
    for step in range(request.start_step, request.start_step + request.num_steps):
      if token is not None and token.cancelled:
        raise Cancelled(f"dataset {request.dataset!r}: cancelled")
      if total is not None and step >= total:
        raise InvalidRequestError(f"step {step} is past the end ({total} steps)")
      if at is not None and at >= self.stream_end:
        raise EndOfDataError(f"the stream ended at step {step}")
      values, after = self.global_batch(step, g, request.record_offset, at)
      at = after
      out.append(Step([host_rows(values, request)], position(after) if after is not None
                      else ""))
    return out

  def skip(self, request: pb.BatchRequest, token: Any = None) -> pb.SkipResponse:
    self._check(request)
    assert self.info.stream, "a skip of a dataset read by step"
    assert not request.compression, "a skip sends no batches to compress"
    with self._lock:
      self.requests.append(request)
    at = self._at(request)
    for step in range(request.start_step, request.start_step + request.num_steps):
      if at >= self.stream_end:
        raise EndOfDataError(f"the stream ended at step {step}")
      _, at = self.global_batch(step, request.global_batch_size, at=at)
    return pb.SkipResponse(next_step=request.start_step + request.num_steps,
                           next_stream_state=position(at))

  def explain(self, request: pb.ExplainRequest) -> dict[str, Any]:
    """A summary of a stream's steps: per step, rows and tokens (its values'
    sum), two sources (`even`, `odd`) whose counts are its even and odd
    values."""
    assert request.summary and self.info.stream, "only a stream's summary is faked"
    r = request.request
    self._check(r)
    assert (r.shard_index, r.shard_count) == (0, 1), "a summary counts whole global batches"
    with self._lock:
      self.explains.append(request)
    at = self._at(r)
    counts = {"even": dict.fromkeys(("tokens", "segments", "documents"), 0),
              "odd": dict.fromkeys(("tokens", "segments", "documents"), 0)}
    rows = tokens = 0
    for step in range(r.start_step, r.start_step + r.num_steps):
      values, at = self.global_batch(step, r.global_batch_size, at=at)
      rows += len(values)
      tokens += int(values.sum())
      for name, part in (("even", values[values % 2 == 0]), ("odd", values[values % 2 == 1])):
        counts[name]["tokens"] += int(part.sum())
        counts[name]["segments"] += len(part)
        counts[name]["documents"] += step + 1
    return {"dataset": r.dataset, "steps": [r.start_step, r.start_step + r.num_steps],
            "next_stream_state": position(at), "rows": rows, "padding_rows": 0,
            "tokens": tokens, "components": {
                name: {**c, "share": c["tokens"] / tokens if tokens else 0.0}
                for name, c in counts.items()}}

  def close(self) -> None:
    with self._lock:
      self.closed = True


class _JsonIterator(grain.DatasetIterator):
  """An iterator whose states are only ever JSON text, parsed: what a
  checkpoint on disk holds."""

  def __init__(self, it: grain.DatasetIterator):
    super().__init__()
    self._it = it

  def __next__(self) -> Any:
    return next(self._it)

  def get_state(self) -> dict[str, Any]:
    return json.loads(json.dumps(self._it.get_state()))

  def set_state(self, state: dict[str, Any]) -> None:
    self._it.set_state(json.loads(json.dumps(state)))


class Restartable:
  """What Grain's checkpoint check iterates: each `iter()` a fresh iterator
  from `make`, its every state saved and restored through JSON."""

  def __init__(self, make: Callable[[], grain.DatasetIterator]):
    self._make = make

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonIterator(self._make())
