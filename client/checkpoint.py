"""Restoring the client's state from Grain's orbax checkpoint, for any host count.

Grain's handler (`grain.checkpoint.CheckpointSave`) writes one
`process_<i>-of-<n>.json` per host, and its `CheckpointRestore` reads the file
of the current (i, n), so it fails when a job comes back on a different number
of hosts. The grain-elevator cursor is global and identical on every host, so
any host's file resumes every host: `restore` reads whichever exist.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from grain_elevator.proto.errors import InvalidRequestError


def load_state(directory: str | pathlib.Path) -> dict[str, Any]:
  """The iterator state saved in a Grain checkpoint item directory."""
  directory = pathlib.Path(directory)
  files = sorted(directory.glob("process_*-of-*.json"))
  if not files:
    raise FileNotFoundError(
        f"no Grain iterator state (process_*-of-*.json) in {directory}")
  states = {f.name: json.loads(f.read_text()) for f in files}
  first_name, first = next(iter(states.items()))
  for name, state in states.items():
    if state != first:
      raise InvalidRequestError(
          f"hosts saved different iterator states in {directory}: {first_name} "
          f"has {first}, {name} has {state}; a grain-elevator cursor is the same "
          "on every host, so these are not from one job")
  return first


def restore(iterator: Any, directory: str | pathlib.Path) -> Any:
  """Sets `iterator` to the state saved in `directory`, whatever the host count.

  Use it where `grain.checkpoint.CheckpointRestore` would look for this host's
  own file, e.g. `restore(it, manager.directory / str(step) / "data")`.
  """
  iterator.set_state(load_state(directory))
  return iterator
