"""Bad requests get a precise gRPC status; the server keeps serving (the
session's in-process 2-worker server: these tests only read)."""

from __future__ import annotations

import grpc
import pytest

from grain_elevator.client import (InvalidRequestError, RemoteDataset,
                                   UnknownDatasetError)
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import errors, wire
from grain_elevator.server import Server
from helpers import assert_trees_equal, oracle_batch

OK = dict(dataset="plain", global_batch_size=64, shard_index=0, shard_count=1,
          start_step=0, num_steps=1)


@pytest.fixture(scope="module")
def server(serve) -> Server:
  return serve(workers=2)


@pytest.fixture(scope="module")
def stub(server):
  with grpc.insecure_channel(server.target) as channel:
    yield pb_grpc.ElevatorStub(channel)


@pytest.mark.parametrize("change,code,message", [
    (dict(dataset="nope"), grpc.StatusCode.NOT_FOUND,
     "unknown dataset 'nope'; this server offers: aug2, eval, forever, plain, raw, seed3, seed3fast"),
    (dict(global_batch_size=0), grpc.StatusCode.INVALID_ARGUMENT,
     "global_batch_size must be >= 1, got 0"),
    (dict(global_batch_size=-3), grpc.StatusCode.INVALID_ARGUMENT,
     "global_batch_size must be >= 1"),
    (dict(global_batch_size=64, shard_count=3), grpc.StatusCode.INVALID_ARGUMENT,
     "global_batch_size 64 is not divisible by shard_count 3"),
    (dict(shard_count=4, shard_index=4), grpc.StatusCode.INVALID_ARGUMENT,
     r"shard_index must be in [0, 4) for shard_count 4, got 4"),
    (dict(shard_count=0), grpc.StatusCode.INVALID_ARGUMENT, "shard_count must be in"),
    (dict(shard_index=-1, shard_count=2), grpc.StatusCode.INVALID_ARGUMENT,
     "shard_index must be in"),
    (dict(num_steps=0), grpc.StatusCode.INVALID_ARGUMENT, "num_steps must be >= 1"),
    (dict(start_step=-1), grpc.StatusCode.INVALID_ARGUMENT, "start_step must be >= 0"),
    (dict(start_step=15), grpc.StatusCode.OUT_OF_RANGE,
     "steps [15, 16) reach past the end: the stream has 15 steps"),
    (dict(start_step=10, num_steps=10), grpc.StatusCode.OUT_OF_RANGE, "past the end"),
    (dict(record_offset=-1), grpc.StatusCode.INVALID_ARGUMENT,
     "record_offset must be in [0, 1000]"),
    (dict(record_offset=1001), grpc.StatusCode.INVALID_ARGUMENT, "got 1001"),
    (dict(record_offset=960, start_step=0), grpc.StatusCode.OUT_OF_RANGE,
     "the stream has 0 steps of global batch size 64 after record 960"),
    (dict(global_batch_size=1 << 40), grpc.StatusCode.INVALID_ARGUMENT,
     "over the server's --max-message-bytes of 268435456"),
    (dict(config_fingerprint="ffffffffffffffff"), grpc.StatusCode.FAILED_PRECONDITION,
     "expects config fingerprint ffffffffffffffff"),
])
def test_bad_request_gets_its_status(stub, oracle, change, code, message):
  with pytest.raises(grpc.RpcError) as info:
    list(stub.GetBatches(pb.BatchRequest(**{**OK, **change}), timeout=30))
  assert info.value.code() == code
  assert message in info.value.details()
  # The same worker pool still serves a good request correctly.
  (batch,) = stub.GetBatches(pb.BatchRequest(**OK), timeout=30)
  (info_,) = oracle.describe("plain")
  _, got = wire.decode_batch(batch.SerializeToString(), info_.element_spec.structure)
  assert_trees_equal(got, oracle_batch(oracle, "plain", 0, 64))


def test_describe(stub):
  names = [d.name for d in stub.Describe(pb.DescribeRequest()).datasets]
  assert names == ["aug2", "eval", "forever", "plain", "raw", "seed3", "seed3fast"]
  (info,) = stub.Describe(pb.DescribeRequest(dataset="aug2", global_batch_size=96)).datasets
  assert (info.num_records, info.num_epochs, info.shuffle, info.seed) == (1000, 2, True, 7)
  assert (info.steps_per_epoch, info.total_steps) == (10, 20)
  assert [(l.path, l.dtype, list(l.shape)) for l in info.element_spec.leaves] == [
      ("id", "int64", []), ("image", "uint8", [4, 4, 3]),
      ("label", "int64", []), ("noise", "float32", [])]
  (forever,) = stub.Describe(pb.DescribeRequest(dataset="forever", global_batch_size=8)).datasets
  assert forever.total_steps == -1
  with pytest.raises(grpc.RpcError) as e:
    stub.Describe(pb.DescribeRequest(dataset="nope"))
  assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("embedded", [False, True])
def test_client_raises_typed_errors(server, config_path, embedded):
  target = f"local:{config_path}" if embedded else server.target
  with pytest.raises(UnknownDatasetError, match="unknown dataset 'nope'"):
    iter(RemoteDataset(target, "nope", 8))
  with pytest.raises(InvalidRequestError, match="not divisible"):
    RemoteDataset(target, "plain", 10, shard_index=0, shard_count=3)


def test_health_and_reflection(server):
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
  with grpc.insecure_channel(server.target) as channel:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "grain_elevator.v1.Elevator"):
      status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
      assert status.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (response,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for s in response.list_services_response.service}
    assert "grain_elevator.v1.Elevator" in names


@pytest.mark.parametrize("cls", errors.ERRORS, ids=lambda c: c.__name__)
def test_each_error_travels_as_its_own_class(cls):
  code, message, type_name = errors.status_of(cls("why"))
  back = errors.from_status(code, message, type_name)
  assert type(back) is cls and str(back) == "why" and back.code == code == cls.code


def test_a_status_without_a_class_name_gets_the_tables_class():
  """What another language's server sends: a code and a message."""
  assert type(errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, "x")) is (
      errors.StreamMismatchError)
  assert type(errors.from_status(grpc.StatusCode.NOT_FOUND, "x", "NoSuchError")) is (
      errors.UnknownDatasetError)
  # A name that does not fit its code is not trusted.
  assert type(errors.from_status(grpc.StatusCode.NOT_FOUND, "x", "DataLossError")) is (
      errors.UnknownDatasetError)
  other = errors.from_status(grpc.StatusCode.PERMISSION_DENIED, "no")
  assert type(other) is errors.ElevatorError and other.code == grpc.StatusCode.PERMISSION_DENIED


def test_every_client_error_is_an_exported_elevator_error():
  import grain_elevator.client as client
  for cls in errors.ERRORS:
    assert issubclass(cls, errors.ElevatorError)
    assert getattr(client, cls.__name__) is cls and cls.__name__ in client.__all__
