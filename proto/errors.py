"""The error family, and the one table between errors and gRPC statuses.

Every error the client raises, the server answers with or embedded mode
raises is an `ElevatorError`. Each class carries the status code it travels
as; on the wire a status also carries the class name (gRPC trailing metadata
`ERROR_TYPE_KEY`, the bulk transport's `BulkStatus.error_type`), so a client
raises exactly the type the server raised, even where two types share a code
(`ConfigError` and `StreamMismatchError` are both FAILED_PRECONDITION).
A peer that sends no name (another language's server) gets the table's type
for its code.
"""

from __future__ import annotations

import grpc

# Trailing-metadata key that names the error class of a failed gRPC call.
ERROR_TYPE_KEY = "grain-elevator-error-type"


class ElevatorError(Exception):
  """Base class of every grain-elevator error."""

  code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class UnknownDatasetError(ElevatorError, KeyError):
  """A client named a dataset the server does not offer."""

  code = grpc.StatusCode.NOT_FOUND

  def __str__(self) -> str:  # KeyError would quote the message.
    return str(self.args[0]) if self.args else ""


class InvalidRequestError(ElevatorError, ValueError):
  """Bad batch geometry, steps, options or cursor: G < 1, G % H != 0, h out
  of range, a bad step number or compression, a batch over
  `--max-message-bytes`, ..."""

  code = grpc.StatusCode.INVALID_ARGUMENT


class EndOfDataError(ElevatorError, IndexError):
  """A step at or past the end of a finite dataset (a stream dataset's end
  shows only when a request reaches it)."""

  code = grpc.StatusCode.OUT_OF_RANGE


class StreamMismatchError(ElevatorError, ValueError):
  """A cursor or request made for another stream (config, seed, G), or a
  config fingerprint other than the server's (replicas with different
  configs)."""

  code = grpc.StatusCode.FAILED_PRECONDITION


class ShardChangedError(StreamMismatchError):
  """A shard file, or a file a dataset's options name (a tokenizer), is not
  the one the server started with: serving it would give other records
  under the same stream fingerprint."""


class ConfigError(ElevatorError):
  """The server's dataset config or options are wrong: found at start-up,
  or when a stream's pipeline breaks what a stream must keep (fixed row
  shapes, a bounded position)."""

  code = grpc.StatusCode.FAILED_PRECONDITION


class DataLossError(ElevatorError):
  """A step's data cannot be made: a shard is corrupt or truncated (names
  the file and record), or the pipeline raised (names the dataset, step
  and exception)."""

  code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(ElevatorError, PermissionError):
  """The server wants a (different) bearer token."""

  code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhaustedError(ElevatorError):
  """A server is at its limit of concurrent requests; clients back off."""

  code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InternalError(ElevatorError):
  """The server failed in code of its own (a pipeline that raises is a
  DataLossError naming the dataset, step and exception)."""

  code = grpc.StatusCode.INTERNAL


class ServiceUnavailableError(ElevatorError, ConnectionError):
  """No replica answered within the client's retry window, or a server is
  shutting down."""

  code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ElevatorError):
  """The work was cancelled: the client closed or moved its iterator."""

  code = grpc.StatusCode.CANCELLED


# The table. For a code without a type name, the first class with that code.
ERRORS: tuple[type[ElevatorError], ...] = (
    UnknownDatasetError, InvalidRequestError, EndOfDataError, StreamMismatchError,
    ShardChangedError, ConfigError, DataLossError, UnauthenticatedError, ResourceExhaustedError,
    InternalError, ServiceUnavailableError, Cancelled)
_BY_NAME = {cls.__name__: cls for cls in ERRORS}
_BY_CODE: dict[grpc.StatusCode, type[ElevatorError]] = {}
for _cls in ERRORS:
  _BY_CODE.setdefault(_cls.code, _cls)
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_of(error: ElevatorError) -> tuple[grpc.StatusCode, str, str]:
  """(code, message, type name): what a server sends for `error`."""
  return error.code, str(error), type(error).__name__


def code_from_number(number: int) -> grpc.StatusCode:
  """The StatusCode for its number on the wire (UNKNOWN if none)."""
  return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def from_status(code: grpc.StatusCode, details: str, type_name: str = "") -> ElevatorError:
  """The error a client raises for a status a server returned."""
  cls = _BY_NAME.get(type_name)
  if cls is None or cls.code != code:
    cls = _BY_CODE.get(code, ElevatorError)
  err = cls(details)
  if cls is ElevatorError:
    err.code = code
  return err
