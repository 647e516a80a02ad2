"""The code's graph runs one way. One table says which folder may import
which, for every folder, and every module's imports are checked against it;
each package is also imported in a fresh interpreter and what it loaded is
inspected, and so is what a running worker loaded."""

from __future__ import annotations

import ast
import graphlib
import json
import pathlib
import subprocess
import sys

import pytest

from grain_elevator.tools.testing.launcher import LocalServer
import datasets
from helpers import ROOT, worker_pids

# What importing each package may load of the others.
ALLOWED = {
    "proto": {"proto"},
    "server": {"proto", "pipelines", "server"},
    "client": {"proto", "client"},
    "pipelines": {"proto", "pipelines"},
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
  modules = [
      "grain_elevator." + ".".join((side, *f.relative_to(ROOT / side).with_suffix("").parts))
      .removesuffix(".__init__")
      for f in sorted((ROOT / side).rglob("*.py")) if f.stem != "generate"]  # a dev script
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


def _client_imports(path) -> set[str]:
  """The client modules (`transport.pool`, `window`, ...) that module `path`
  imports, anywhere in its body (type-checking imports included)."""
  import ast  # pylint: disable=g-import-not-at-top
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):  # `from grain_elevator.client import window` too
      names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
    else:
      names = []
    out.update(n.removeprefix("grain_elevator.client.") for n in names
               if n.startswith("grain_elevator.client."))
  return out


def test_nothing_in_client_imports_remote_dataset_but_the_package():
  """RemoteDataset sits on top: what reads for it takes its ReadSpec
  (client/read_spec.py), so no module under it imports it, not even to
  type-check (the readers, their skeleton and RemoteDataset made a circle)."""
  importers = {str(path.relative_to(ROOT)) for path in sorted((ROOT / "client").rglob("*.py"))
               if {n.split(".")[0] for n in _client_imports(path)} & {"remote_dataset"}}
  assert importers <= {"client/__init__.py"}, f"these import remote_dataset: {sorted(importers)}"


_PROBE = '''
import json, os, sys
from grain_elevator.pipelines import examples

def decode(ds, *, out, **options):
  """decode_images, writing down which tools modules this process has loaded."""
  loaded = sorted(m for m in sys.modules if m.startswith("grain_elevator.tools"))
  with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
    json.dump(loaded, f)
  return examples.decode_images(ds, **options)
'''


def test_a_worker_runs_nothing_from_tools(data_dir, tmp_path):
  """What a config names is runtime code (grain_elevator.pipelines): a worker
  loads no module of tools/ but the `elevator` entry module itself, which
  multiprocessing's spawn re-imports in every child."""
  (tmp_path / "probe_pipeline.py").write_text(_PROBE)
  config = datasets.write_config(
      tmp_path / "elevator.toml",
      probe=datasets.images(data_dir / datasets.SHARDS, pipeline="probe_pipeline:decode",
                            options={"out": str(tmp_path)}))
  with LocalServer(config, workers=2, env={"PYTHONPATH": str(tmp_path)}) as server:
    workers = worker_pids(server)
  assert len(workers) == 2
  for pid in workers:
    loaded = json.loads((tmp_path / f"{pid}.json").read_text())
    assert set(loaded) <= {"grain_elevator.tools", "grain_elevator.tools.cli"}, loaded


# Which folders each folder's modules may import (beyond its own), named as
# packages below grain_elevator; what a listed folder may import comes with
# it. Every folder of the code is a key, so a new one is placed here before it
# lands, and the table has no cycle, so every pair of folders points one way
# at most. A module's imports count wherever they stand in its body,
# type-checking imports too.
MAY_IMPORT: dict[str, set[str]] = {
    "proto": set(),  # the wire and the contract, shared by both sides
    "pipelines": {"proto"},  # runtime code configs name
    # server/: data <- serving <- process; inside data/, storage <- shards <-
    # the datasets <- streams/ <- registry/; serving's metrics/ below the rest.
    "server.data.storage": {"proto"},
    "server.data.shards": {"server.data.storage"},
    "server.data": {"pipelines", "server.data.shards"},
    "server.data.streams": {"server.data"},
    "server.data.registry": {"server.data.streams"},
    "server.serving.metrics": {"proto"},
    "server.serving": {"server.data.registry", "server.serving.metrics"},
    "server.process": {"server.serving"},
    "server": {"server.process"},  # the public surface
    # client/: transport/ is the floor; embedded mode imports the serving
    # engine inside a function, when a `local:` target is first used.
    "client.transport": {"proto"},
    "client": {"client.transport", "server.serving"},
    # tools/ on top: the test infrastructure, converters, the library modules
    # of the demos and benches (tools/*.py), the benches.
    "tools.testing": {"server.process"},
    "tools.convert": {"pipelines", "server.data.storage"},
    "tools": {"client", "server", "tools.convert", "tools.testing"},
    "tools.bench": {"tools"},
}
TOPS = ("proto", "server", "client", "pipelines", "tools")
# Entry points sit above every folder: they may import anything, and nothing
# imports them (the `elevator` command, and `python -m` entries).
ENTRY_POINTS = {"tools/cli.py", "tools/bench/__main__.py"}


def _folders() -> set[str]:
  return {".".join(init.parent.relative_to(ROOT).parts)
          for top in TOPS for init in (ROOT / top).rglob("__init__.py")}


def _closure(folder: str) -> set[str]:
  seen, todo = set(), [folder]
  while todo:
    for below in MAY_IMPORT[todo.pop()] - seen:
      seen.add(below)
      todo.append(below)
  return seen


def _imported_folders(path: pathlib.Path, folders: set[str]) -> set[str]:
  """The folders (as MAY_IMPORT names them) whose modules `path` imports."""
  def folder_of(name: str) -> str | None:
    parts = name.split(".")[1:]  # below grain_elevator
    for end in range(len(parts), 0, -1):
      if ".".join(parts[:end]) in folders:
        return ".".join(parts[:end])
    return None
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from pkg import name`: the module pkg.name where it is one (pkg
      # itself is then only its path), else pkg.
      names = [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    out |= {folder_of(n) for n in names if n.startswith("grain_elevator.")} - {None}
  return out


def test_the_table_names_every_folder_and_runs_one_way():
  assert set(MAY_IMPORT) == _folders(), (
      f"folders missing from MAY_IMPORT: {sorted(_folders() - set(MAY_IMPORT))}; "
      f"named but absent: {sorted(set(MAY_IMPORT) - _folders())}")
  graphlib.TopologicalSorter(MAY_IMPORT).prepare()  # raises CycleError on a cycle


def test_every_module_imports_only_what_the_table_allows():
  folders = _folders()
  against = []
  for top in TOPS:
    for path in sorted((ROOT / top).rglob("*.py")):
      if str(path.relative_to(ROOT)) in ENTRY_POINTS:
        continue
      folder = ".".join(path.parent.relative_to(ROOT).parts)
      against += [f"{path.relative_to(ROOT)} -> {imported}"
                  for imported in sorted(_imported_folders(path, folders) - {folder}
                                         - _closure(folder))]
  assert not against, "imports MAY_IMPORT does not allow: " + ", ".join(against)


def test_nothing_imports_an_entry_point():
  entries = {"grain_elevator." + p.removesuffix(".py").replace("/", ".") for p in ENTRY_POINTS}
  importers = []
  for top in TOPS:
    for path in sorted((ROOT / top).rglob("*.py")):
      if str(path.relative_to(ROOT)) in ENTRY_POINTS:
        continue
      for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                 if isinstance(node, ast.ImportFrom) else [])
        importers += [f"{path.relative_to(ROOT)} -> {n}" for n in names if n in entries]
  assert not importers, f"entry points imported: {importers}"
