"""The converter's errors: ValueErrors that say which file, where and what to do.

They do not derive from `grain_elevator.proto.errors.ElevatorError`, which
imports grpc; the CLI prints them as it prints ElevatorErrors
(``elevator: error: ...``, exit status 2).
"""

from __future__ import annotations


class ConvertError(ValueError):
  """A conversion cannot go on: bad arguments, an unsupported input or an
  output folder it must not touch. Nothing that looks complete is left."""


class CorruptInputError(ConvertError):
  """An input file is corrupt or truncated: names the file and byte offset."""

  def __init__(self, path: str, offset: int, what: str):
    super().__init__(f"{path}: at byte {offset}: {what}")
    self.path = path
    self.offset = offset
    self.what = what

  def __reduce__(self):  # crosses process boundaries (worker pools, Beam)
    return type(self), (self.path, self.offset, self.what)
