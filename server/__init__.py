"""The serving side of grain-elevator: what an `elevator serve` process runs.

    from grain_elevator.server import Server, ServerOptions
    with Server("elevator.toml", ServerOptions(port=0)) as server:
      print(server.target)  # "127.0.0.1:PORT", for RemoteDataset

The request path every request goes through is `request_path.py`; the
transports around it are `grpc_service.py` and `bulk.py`.
"""

from grain_elevator.proto.errors import (ConfigError, DataLossError, ElevatorError,
                                         InternalError)
from grain_elevator.server.config import DatasetConfig, ServerConfig, load_config
from grain_elevator.server.options import ServerOptions
from grain_elevator.server.sockets import BindError
from grain_elevator.server.supervisor import Server, StartError, serve

__all__ = [
    "Server", "ServerOptions", "serve", "load_config", "ServerConfig", "DatasetConfig",
    "ElevatorError", "ConfigError", "StartError", "BindError", "DataLossError",
    "InternalError",
]
