"""The serving side of grain-elevator: what an `elevator serve` process runs.

    from grain_elevator.server import Server, ServerOptions
    with Server("elevator.toml", ServerOptions(port=0)) as server:
      print(server.target)  # "127.0.0.1:PORT", for RemoteDataset

The request path every request goes through is `request_path.py`; the
transports around it are `grpc_service.py` and `bulk.py`.

Names are imported on first use, so that a module of this package (the
health probe's logging, embedded mode's dataset engine) loads without the
whole server.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_EXPORTS = {
    "Server": "supervisor", "serve": "supervisor", "StartError": "supervisor",
    "ServerOptions": "options", "BindError": "sockets",
    "load_config": "config", "ServerConfig": "config", "DatasetConfig": "config",
}
_ERRORS = ("ElevatorError", "ConfigError", "DataLossError", "InternalError")
__all__ = [*_EXPORTS, *_ERRORS]


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
