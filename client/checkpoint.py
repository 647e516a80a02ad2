"""Restoring the client's state from Grain's orbax checkpoint, for any host count.

Grain's handler (`grain.checkpoint.CheckpointSave`) writes one
`process_<i>-of-<n>.json` per host, and its `CheckpointRestore` reads the file
of the current (i, n), so it fails when a job comes back on a different number
of hosts. The grain-elevator cursor is global and identical on every host, so
any host's file resumes every host: `restore` reads whichever exist.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from grain_elevator.client import state as state_lib
from grain_elevator.proto.errors import InvalidRequestError


def load_state(directory: str | pathlib.Path) -> dict[str, Any]:
  """The iterator state saved in a Grain checkpoint item directory."""
  directory = pathlib.Path(directory)
  files = sorted(directory.glob("process_*-of-*.json"))
  if not files:
    raise FileNotFoundError(
        f"no Grain iterator state (process_*-of-*.json) in {directory}")
  states = {f.name: state_lib.read(f) for f in files}  # bounded (state_lib.parse)
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


def skip_saved(path: str | pathlib.Path, num_steps: int) -> dict[str, Any]:
  """Writes a skip of `num_steps` global batches into a saved state, in
  place (`elevator cursor skip`): a JSON file holding the state, or a Grain
  checkpoint item directory (every host's file). Returns the new state. A
  job restored from it skips them, on any host count (state.with_skip)."""
  path = pathlib.Path(path)
  files = sorted(path.glob("process_*-of-*.json")) if path.is_dir() else [path]
  state = state_lib.with_skip(load_state(path) if path.is_dir() else state_lib.read(path),
                              num_steps)
  for f in files:  # each replaced whole: a reader sees the old state or the new
    tmp = f.with_name(f".{f.name}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, f)
  return state
