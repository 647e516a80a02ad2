"""The package graph runs one way: proto <- server, proto <- client,
proto <- pipelines, and tools on top. Each package is imported in a fresh
interpreter and what it loaded is inspected; so is what a running worker
loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from grain_elevator.tools.testing.launcher import LocalServer
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


def test_client_transport_imports_nothing_above_it():
  """Inside client/, transport/ is the floor: the iterators, the window and
  the options' users sit on it, and it imports none of them."""
  upward = {(str(path.relative_to(ROOT)), name)
            for path in sorted((ROOT / "client" / "transport").rglob("*.py"))
            for name in _client_imports(path) if not name.startswith("transport")}
  assert not upward, f"client/transport/ imports above it: {sorted(upward)}"


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
  config = tmp_path / "elevator.toml"
  config.write_text(textwrap.dedent(f"""\
      [datasets.probe]
      paths = ["{data_dir}/shards/*.array_record"]
      pipeline = "probe_pipeline:decode"
      [datasets.probe.options]
      out = "{tmp_path}"
      height = 4
      width = 4
      channels = 3
      """))
  with LocalServer(str(config), workers=2, env={"PYTHONPATH": str(tmp_path)}) as server:
    workers = worker_pids(server)
  assert len(workers) == 2
  for pid in workers:
    loaded = json.loads((tmp_path / f"{pid}.json").read_text())
    assert set(loaded) <= {"grain_elevator.tools", "grain_elevator.tools.cli"}, loaded


# Inside server/, the folders run one way too: data/ (what a step is made
# of) <- serving/ (a request's path) <- process/ (a server's life). A module
# may import its own folder and those below it, anywhere in its body.
SERVER_LAYERS = ("data", "serving", "process")


def _server_imports(path) -> set[str]:
  """The server folders (data, serving, process) that module `path` imports."""
  import ast  # pylint: disable=g-import-not-at-top
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
             else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    for name in names:
      parts = name.split(".")
      if parts[:2] == ["grain_elevator", "server"] and len(parts) > 2:
        out.add(parts[2])
  return out


def test_server_folders_import_downward():
  upward = set()
  for path in sorted((ROOT / "server").rglob("*.py")):
    folder = path.relative_to(ROOT / "server").parts[0]
    if folder not in SERVER_LAYERS:
      continue
    level = SERVER_LAYERS.index(folder)
    for imported in _server_imports(path) & set(SERVER_LAYERS):
      if SERVER_LAYERS.index(imported) > level:
        upward.add((str(path.relative_to(ROOT / "server")), imported))
  assert not upward, f"imports that run upward: {sorted(upward)}"


# Inside server/data/, the rooms run one way too: storage/ (a bucket) <-
# shards/ (a shard, read from a file or through storage/) <- the rest of
# data/ (the datasets, streams/). A pair that pointed both ways before
# (read_ahead.py took shards/' coalesce; identity.py took data/config.py's
# classes) would hide which one a change must start from.
DATA_ROOMS = ("storage", "shards")


def _data_rooms(path) -> set[int]:
  """The levels of the server/data/ modules that module `path` imports:
  its DATA_ROOMS index, or len(DATA_ROOMS) for any other data/ module."""
  import ast  # pylint: disable=g-import-not-at-top
  top = len(DATA_ROOMS)

  def level(parts: list[str]) -> int | None:
    if parts[:3] != ["grain_elevator", "server", "data"]:
      return None
    return DATA_ROOMS.index(parts[3]) if len(parts) > 3 and parts[3] in DATA_ROOMS else top
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found = [level(a.name.split(".")) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module == "grain_elevator.server.data":
      found = [level([*node.module.split("."), a.name]) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      found = [level((node.module or "").split("."))]
    else:
      continue
    out |= {l for l in found if l is not None}
  return out


def test_data_rooms_import_downward():
  upward = set()
  for path in sorted((ROOT / "server" / "data").rglob("*.py")):
    room = path.relative_to(ROOT / "server" / "data").parts[0]
    if room not in DATA_ROOMS:
      continue
    for imported in _data_rooms(path):
      if imported > DATA_ROOMS.index(room):
        upward.add((str(path.relative_to(ROOT / "server")),
                    DATA_ROOMS[imported] if imported < len(DATA_ROOMS) else "data"))
  assert not upward, f"imports that run upward: {sorted(upward)}"
