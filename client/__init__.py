"""The trainer side of grain-elevator: a Grain IterDataset fed by the service.

    from grain_elevator.client import RemoteDataset
    ds = RemoteDataset("localhost:50051", "train", global_batch_size=256)

Importing it loads no server module; a "local:CONFIG" target (embedded mode)
loads the serving engine when first used. `to_device` needs the `jax` extra;
PyTorch trainers use `grain_elevator.client.torch` (the `torch` extra).
"""

from grain_elevator.client import checkpoint
from grain_elevator.client.device import to_device
from grain_elevator.client.remote_dataset import RemoteDataset, describe
from grain_elevator.client.stats import Stats, start_metrics_server
from grain_elevator.client.transport.options import RetryPolicy, Security, TransportOptions
from grain_elevator.proto.errors import (Cancelled, ConfigError, DataLossError, ElevatorError,
                                         EndOfDataError, InternalError, InvalidRequestError,
                                         ResourceExhaustedError, ServiceUnavailableError,
                                         ShardChangedError, StreamMismatchError,
                                         UnauthenticatedError,
                                         UnknownDatasetError)
from grain_elevator.proto.spec import DatasetInfo

__all__ = [
    "RemoteDataset", "describe", "to_device", "checkpoint",
    "TransportOptions", "RetryPolicy", "Security", "DatasetInfo", "Stats", "start_metrics_server",
    "ElevatorError", "Cancelled", "ConfigError", "DataLossError", "EndOfDataError",
    "InternalError", "InvalidRequestError", "ResourceExhaustedError",
    "ServiceUnavailableError", "ShardChangedError", "StreamMismatchError",
    "UnauthenticatedError", "UnknownDatasetError",
]
