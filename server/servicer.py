"""The gRPC servicer: Describe and GetBatches over a worker's datasets.

Stateless per client: a request names (dataset, G, h, H, steps) and the
answer depends on nothing else, so any worker of any replica can serve it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import grpc

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.server import dataset as dataset_lib
from grain_elevator.server import errors
from grain_elevator.server.errors import ElevatorError, InternalError, InvalidRequestError

log = logging.getLogger("grain_elevator.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Elevator"].full_name


class ElevatorServicer(pb_grpc.ElevatorServicer):
  """Serves the datasets of one worker process."""

  def __init__(self, datasets: dict[str, dataset_lib.ElevatorDataset],
               worker_index: int = 0, num_workers: int = 1):
    self._datasets = datasets
    self._server = pb.ServerInfo(worker_index=worker_index, num_workers=num_workers)

  @property
  def server_info(self) -> pb.ServerInfo:
    return self._server

  def set_bulk_port(self, port: int) -> None:
    self._server.bulk_port = port

  def Describe(self, request: pb.DescribeRequest,
               context: grpc.ServicerContext) -> pb.DescribeResponse:
    try:
      if request.global_batch_size < 0:
        raise InvalidRequestError(
            f"global_batch_size must be >= 0, got {request.global_batch_size}")
      if request.dataset:
        chosen = [dataset_lib.lookup(self._datasets, request.dataset)]
      else:
        chosen = [self._datasets[n] for n in sorted(self._datasets)]
    except ElevatorError as e:
      context.abort(e.code, str(e))
    return pb.DescribeResponse(
        datasets=[d.info.to_proto(request.global_batch_size) for d in chosen],
        server=self._server)

  def batches(self, r: pb.BatchRequest,
              is_active: Callable[[], bool] = lambda: True) -> Iterator[list[Any]]:
    """Each step of `r` as the buffers of one serialized Batch.

    Shared by gRPC and the bulk transport; raises ElevatorError (with the
    status code to answer) naming the dataset and step.
    """
    ds = dataset_lib.lookup(self._datasets, r.dataset)
    ds.check_request(r.global_batch_size, r.shard_index, r.shard_count,
                     r.start_step, r.num_steps, r.config_fingerprint)
    if r.compression not in (wire.COMPRESSION_NONE, wire.COMPRESSION_ZSTD):
      raise InvalidRequestError(f"unknown compression {r.compression}")
    for step in range(r.start_step, r.start_step + r.num_steps):
      if not is_active():  # The client went away: stop computing.
        return
      try:
        leaves = ds.host_batch_leaves(step, r.global_batch_size, r.shard_index,
                                      r.shard_count, stack=False)
      except ElevatorError as e:  # e.g. DATA_LOSS naming the shard and record
        log.error("dataset %r step %d: %s", r.dataset, step, e)
        raise errors.from_status(e.code, f"dataset {r.dataset!r}, step {step}: {e}") from e
      except Exception as e:  # pylint: disable=broad-except
        log.exception("dataset %r step %d failed", r.dataset, step)
        raise InternalError(f"dataset {r.dataset!r}, step {step}: "
                            f"{type(e).__name__}: {e}") from e
      yield wire.encode_batch_parts(step, leaves, r.compression)

  def GetBatches(self, request: pb.BatchRequest,
                 context: grpc.ServicerContext) -> Iterator[bytes]:
    """Yields serialized `Batch` messages (see `add_to_server`)."""
    try:
      for parts in self.batches(request, context.is_active):
        yield b"".join(parts)
    except ElevatorError as e:
      context.abort(e.code, str(e))


def _pass_through(message: bytes) -> bytes:
  return message


def add_to_server(servicer: ElevatorServicer, server: grpc.Server) -> None:
  """Registers the Elevator service; GetBatches sends pre-encoded bytes.

  Same methods and messages as the generated `add_ElevatorServicer_to_server`,
  but batches skip protobuf object construction (one copy of the tensor data
  instead of three).
  """
  handlers = {
      "Describe": grpc.unary_unary_rpc_method_handler(
          servicer.Describe,
          request_deserializer=pb.DescribeRequest.FromString,
          response_serializer=pb.DescribeResponse.SerializeToString),
      "GetBatches": grpc.unary_stream_rpc_method_handler(
          servicer.GetBatches,
          request_deserializer=pb.BatchRequest.FromString,
          response_serializer=_pass_through),
  }
  server.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
