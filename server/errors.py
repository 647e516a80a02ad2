"""Typed errors shared by the server, the client and embedded mode.

Each carries the gRPC status code the server answers with, so embedded mode
and the remote client raise the same types for the same mistake.
"""

from __future__ import annotations

import grpc


class ElevatorError(Exception):
  """Base class of grain-elevator errors."""

  code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class ConfigError(ElevatorError):
  """The server's dataset config is wrong; raised at start-up."""

  code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownDatasetError(ElevatorError, KeyError):
  """A client named a dataset the server does not offer."""

  code = grpc.StatusCode.NOT_FOUND

  def __str__(self) -> str:  # KeyError would quote the message.
    return str(self.args[0]) if self.args else ""


class InvalidRequestError(ElevatorError, ValueError):
  """Bad batch geometry: G < 1, G % H != 0, h out of range, bad step."""

  code = grpc.StatusCode.INVALID_ARGUMENT


class EndOfDataError(ElevatorError, IndexError):
  """A step at or past the end of a finite dataset."""

  code = grpc.StatusCode.OUT_OF_RANGE


class StreamMismatchError(ElevatorError, ValueError):
  """A cursor or request made for another stream (config, seed, G)."""

  code = grpc.StatusCode.FAILED_PRECONDITION


class DataLossError(ElevatorError):
  """A shard is corrupt or truncated; names the file and record."""

  code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(ElevatorError, PermissionError):
  """The server wants a (different) bearer token."""

  code = grpc.StatusCode.UNAUTHENTICATED


class InternalError(ElevatorError):
  """A pipeline raised on the server; names the dataset, step and exception."""

  code = grpc.StatusCode.INTERNAL


class ServiceUnavailableError(ElevatorError, ConnectionError):
  """No replica answered within the client's retry window."""

  code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {
    cls.code: cls
    for cls in (UnknownDatasetError, InvalidRequestError, EndOfDataError,
                StreamMismatchError, DataLossError, UnauthenticatedError,
                InternalError, ServiceUnavailableError)
}


def from_status(code: grpc.StatusCode, details: str) -> ElevatorError:
  """The typed error for a status a server returned."""
  cls = _BY_CODE.get(code, ElevatorError)
  err = cls(details)
  if cls is ElevatorError:
    err.code = code
  return err
