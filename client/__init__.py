"""The trainer side of grain-elevator: a Grain IterDataset fed by the service.

    from grain_elevator.client import RemoteDataset
    ds = RemoteDataset("localhost:50051", "train", global_batch_size=256)
"""

from grain_elevator.client import checkpoint
from grain_elevator.client.device import to_device
from grain_elevator.client.malloc import tune_malloc
from grain_elevator.client.remote_dataset import RemoteDataset, describe
from grain_elevator.proto.spec import DatasetInfo
from grain_elevator.server.errors import (ConfigError, DataLossError, ElevatorError,
                                          EndOfDataError, InvalidRequestError,
                                          ServiceUnavailableError,
                                          StreamMismatchError,
                                          UnauthenticatedError,
                                          UnknownDatasetError)

__all__ = [
    "RemoteDataset", "checkpoint", "describe", "to_device", "tune_malloc",
    "DatasetInfo", "ElevatorError", "ConfigError", "DataLossError",
    "EndOfDataError", "InvalidRequestError", "ServiceUnavailableError",
    "StreamMismatchError", "UnauthenticatedError", "UnknownDatasetError",
]
