"""The serving side of grain-elevator: what an `elevator serve` process runs.

    from grain_elevator.server import Server, ServerOptions
    with Server("elevator.toml", ServerOptions(port=0)) as server:
      print(server.target)  # "127.0.0.1:PORT", for RemoteDataset

Three folders, one concern each, importing one way (data <- serving <-
process): data/ (what a step is made of), serving/ (a request's path, and
the options a server runs with), process/ (a server's life). Which module
does what: docs/design.md, "server/".

Names are imported on first use, so that a module of this package (a
worker's lifeline, embedded mode's dataset engine) loads without the whole
server; type checkers see them through the TYPE_CHECKING imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from grain_elevator.proto.errors import (Cancelled, ConfigError, DataLossError,
                                           ElevatorError, EndOfDataError, InternalError,
                                           InvalidRequestError, ResourceExhaustedError,
                                           ServiceUnavailableError, ShardChangedError,
                                           StreamMismatchError, UnauthenticatedError,
                                           UnknownDatasetError)
  from grain_elevator.server.data.config import DatasetConfig, ServerConfig, load_config
  from grain_elevator.server.serving.options import ServerOptions
  from grain_elevator.server.serving.sockets import BindError
  from grain_elevator.server.process.supervisor import Server, StartError, serve

# Public name -> the module that defines it.
_EXPORTS = {
    "Server": "process.supervisor", "serve": "process.supervisor",
    "StartError": "process.supervisor", "ServerOptions": "serving.options",
    "BindError": "serving.sockets",
    "load_config": "data.config", "ServerConfig": "data.config", "DatasetConfig": "data.config",
}
__all__ = [
    "Server", "serve", "StartError", "ServerOptions", "BindError",
    "load_config", "ServerConfig", "DatasetConfig",
    # The error family (proto/errors.py), every one a server may raise or answer.
    "ElevatorError", "Cancelled", "ConfigError", "DataLossError", "EndOfDataError",
    "InternalError", "InvalidRequestError", "ResourceExhaustedError",
    "ServiceUnavailableError", "ShardChangedError", "StreamMismatchError",
    "UnauthenticatedError", "UnknownDatasetError",
]
_ERRORS = frozenset(__all__) - frozenset(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _ERRORS:
    module = "grain_elevator.proto.errors"
  elif name in _EXPORTS:
    module = f"grain_elevator.server.{_EXPORTS[name]}"
  else:
    raise AttributeError(f"module 'grain_elevator.server' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted([*globals(), *__all__])
