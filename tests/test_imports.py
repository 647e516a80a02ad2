"""The package graph runs one way: proto <- server, proto <- client, and tools
on top. Each package is imported in a fresh interpreter and what it loaded
is inspected."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What importing each package may load of the others.
ALLOWED = {
    "proto": {"proto"},
    "server": {"proto", "server"},
    "client": {"proto", "client"},
}


def _loaded_after(code: str) -> set[str]:
  """The grain_elevator packages (proto, server, ...) loaded after running `code`."""
  probe = (f"{code}\nimport json, sys\nprint(json.dumps(sorted(m.split('.')[1] for m in "
           "sys.modules if m.startswith('grain_elevator.'))))")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize("side", sorted(ALLOWED))
def test_a_side_loads_only_what_is_below_it(side):
  """Every module of the side, not only its __init__: the client's modules
  load no server module (embedded mode imports the engine inside a
  function), the server's no client module, and proto's neither."""
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1]
  modules = [f"grain_elevator.{side}"] + [
      f"grain_elevator.{side}.{f.stem}" for f in sorted((root / side).glob("*.py"))
      if f.stem not in ("__init__", "generate")]  # generate: a dev script
  loaded = _loaded_after("import importlib\n" + "\n".join(
      f"importlib.import_module({m!r})" for m in modules))
  assert side in loaded
  assert loaded <= ALLOWED[side], f"{side} loads {sorted(loaded - ALLOWED[side])}"


def test_embedded_mode_loads_the_serving_engine_only_when_used(config_path):
  before = "from grain_elevator.client import RemoteDataset\n"
  assert "server" not in _loaded_after(
      before + f"ds = RemoteDataset('local:{config_path}', 'plain', 8)")
  assert "server" in _loaded_after(
      before + f"next(iter(RemoteDataset('local:{config_path}', 'plain', 8)))")
