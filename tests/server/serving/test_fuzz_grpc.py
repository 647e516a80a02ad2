"""Malformed and extreme requests: every one gets a status, no worker dies,
and a normal client still gets correct batches afterwards."""

from __future__ import annotations

import logging

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from grain_elevator.client import RemoteDataset
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree, wire
from grain_elevator.server import Server, ServerOptions
from helpers import assert_streams_equal, assert_trees_equal, oracle_batch

SERVICE = "/grain_elevator.v1.Elevator/"
EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class _Log(logging.Handler):
  """What the in-process server's supervisor logs (a worker's death among it)."""

  def __init__(self) -> None:
    super().__init__(logging.INFO)
    self.lines: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def fuzz_server(config_path):
  """A server of its own, in-process: its supervisor's log is this process's,
  read on the package's logger (which `elevator`'s log set-up stops
  propagating to the root)."""
  logger = logging.getLogger("grain_elevator")
  log, level = _Log(), logger.level
  logger.addHandler(log)
  logger.setLevel(logging.INFO)
  try:
    with Server(config_path, ServerOptions(port=0, workers=2)) as server:
      workers = sorted(server.worker_pids())
      yield server
      with RemoteDataset(server.target, "seed3", 64) as ds:  # still correct after it all
        with RemoteDataset.embedded(config_path, "seed3", 64) as local:
          assert assert_streams_equal(ds, local) == 15
      assert sorted(server.worker_pids()) == workers, "a worker died during fuzzing"
  finally:
    logger.removeHandler(log)
    logger.setLevel(level)
  assert not [l for l in log.lines if "restarting it" in l], "a worker died during fuzzing"


@pytest.fixture(scope="module")
def channel(fuzz_server):
  with grpc.insecure_channel(fuzz_server.target) as c:
    yield c


def _first(channel, method: str, payload: bytes):
  if method == "Describe":
    call = channel.unary_unary(SERVICE + method, request_serializer=None,
                               response_deserializer=None)
    return call(payload, timeout=30)
  stream = channel.unary_stream(SERVICE + method, request_serializer=None,
                                response_deserializer=None)(payload, timeout=30)
  try:
    return next(stream, None)
  finally:
    stream.cancel()


@FUZZ
@given(method=st.sampled_from(["Describe", "GetBatches"]), payload=st.binary(max_size=200))
def test_random_bytes_get_a_status(channel, method, payload):
  try:
    _first(channel, method, payload)
  except grpc.RpcError as e:
    assert e.code() in EXPECTED, (e.code(), e.details())


INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
SMALL = st.integers(-3, 300)


@FUZZ
@given(dataset=st.sampled_from(["plain", "aug2", "forever", "nope", ""]) | st.text(max_size=20),
       g=st.one_of(SMALL, INT64), h=st.one_of(st.integers(-2, 8), INT32),
       n=st.one_of(st.integers(-2, 8), INT32), start=st.one_of(SMALL, INT64),
       num=st.one_of(st.integers(-2, 5), INT64),
       fingerprint=st.sampled_from(["", "0000000000000000"]))
def test_extreme_fields_get_a_status_or_the_right_batch(channel, oracle, dataset, g, h, n,
                                                        start, num, fingerprint):
  request = pb.BatchRequest(dataset=dataset, global_batch_size=g, shard_index=h,
                            shard_count=n, start_step=start, num_steps=num,
                            config_fingerprint=fingerprint)
  try:
    first = _first(channel, "GetBatches", request.SerializeToString())
  except grpc.RpcError as e:
    assert e.code() in EXPECTED, (e.code(), e.details())
    return
  step, leaves = wire.decode_batch_bytes(first)
  (info,) = oracle.describe(dataset)
  assert step == start
  assert_trees_equal(tree.unflatten(info.element_spec.structure, leaves),
                     oracle_batch(oracle, dataset, start, g, h, n))
