"""What a new operator sees when `elevator serve` cannot start, or starts
with noise: each a real `elevator serve` process.

- Data the server's user may not read (a container's uid 10001 on a host
  folder made by `mktemp -d`, mode 0700) is one line naming the path and
  the uid, not a PermissionError's traceback.
- Where JAX is not installed (the image has none), no process logs Grain's
  "Failed to load jax profiler" warning (it did twice, at every start).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.server.process import lifeline
from grain_elevator.tools.testing.launcher import ELEVATOR
import datasets
from datasets import IMAGE

pytestmark = pytest.mark.slow  # each test starts `elevator serve`: a fresh interpreter

# The user the server runs as: the image's (deploy/Dockerfile) where this
# test may switch users (as root, root's modes do not bind it), else this
# process's own, kept out by a mode that keeps even the owner out.
AS_ROOT = os.geteuid() == 0
UID, GID = (10001, 10001) if AS_ROOT else (os.geteuid(), os.getegid())
# As root, util-linux's setpriv drops to it (subprocess's user= could not
# exec this venv's Python here, where setpriv can).
AS_USER = ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups"] if AS_ROOT else []
CLOSED = 0o700 if AS_ROOT else 0o000  # a folder the server may not enter
CLOSED_FILE = 0o600 if AS_ROOT else 0o000
START_TIMEOUT_S = 120  # a fresh interpreter importing Grain: ~3 s measured here


def _serve(config: pathlib.Path, *, cwd: pathlib.Path, env: dict[str, str] | None = None,
           as_user: bool = False, idle_exit_s: float | None = None
           ) -> subprocess.CompletedProcess[str]:
  """`elevator serve` run to its end: as UID:GID where `as_user`."""
  extra = ["--idle-exit-s", f"{idle_exit_s:g}"] if idle_exit_s is not None else []
  return subprocess.run(
      lifeline.tied([*(AS_USER if as_user else []), *ELEVATOR, "serve", "--config",
                     str(config), "--port", "0", "--workers", "1", *extra]),
      capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=cwd,
      env={**os.environ, **(env or {})})


@pytest.fixture
def public_dir() -> Iterator[pathlib.Path]:
  """A folder the server's user may enter: pytest's own tmp_path is under
  /tmp/pytest-of-root, mode 0700, where uid 10001 reaches nothing."""
  root = pathlib.Path(tempfile.mkdtemp(prefix="elevator-perm-"))
  root.chmod(0o755)
  try:
    yield root
  finally:
    for path in [root, *root.rglob("*")]:
      path.chmod(0o700)  # back to where shutil may remove it (as a non-root owner)
    shutil.rmtree(root)


@pytest.fixture
def user_dir(public_dir: pathlib.Path) -> pathlib.Path:
  """`public_dir`, where the server's user can run this checkout's Python
  (skipped, with the reason, where it cannot)."""
  if AS_USER and not shutil.which(AS_USER[0]):
    pytest.skip("running as root, and no setpriv (util-linux) to drop to another uid")
  probe = subprocess.run([*AS_USER, sys.executable, "-c", "import grain_elevator.tools.cli"],
                         capture_output=True, text=True, timeout=START_TIMEOUT_S,
                         cwd=public_dir)
  if probe.returncode != 0:
    pytest.skip(f"uid {UID} cannot run {sys.executable}: {probe.stderr.strip()[-300:]}")
  return public_dir


def _dataset(folder: pathlib.Path) -> pathlib.Path:
  """A small image dataset in `folder`: its config and shards/."""
  folder.mkdir(mode=0o755, exist_ok=True)
  examples.write_image_shards(str(folder / "shards"), num_records=20, num_shards=2, **IMAGE)
  for path in [folder / "shards", *(folder / "shards").iterdir()]:
    path.chmod(0o755 if path.is_dir() else 0o644)
  config = pathlib.Path(datasets.write_config(folder / "elevator.toml", x=datasets.images()))
  config.chmod(0o644)
  return config


def _shut_out_config(config: pathlib.Path) -> str:
  config.parent.chmod(CLOSED)  # `mktemp -d`
  return str(config)


def _shut_out_shards_folder(config: pathlib.Path) -> str:
  (config.parent / "shards").chmod(CLOSED)
  return str(config.parent / "shards")


def _shut_out_shards(config: pathlib.Path) -> str:
  shards = sorted((config.parent / "shards").iterdir())
  for shard in shards:
    shard.chmod(CLOSED_FILE)
  return str(shards[0])


@pytest.mark.parametrize("shut_out", [_shut_out_config, _shut_out_shards_folder,
                                      _shut_out_shards])
def test_data_the_user_may_not_read_is_one_line_naming_path_and_uid(
    user_dir: pathlib.Path, shut_out) -> None:
  # Before: the config's folder gave a PermissionError's traceback (exit 1);
  # the shards' folder "matches no files"; the shards "cannot be opened:
  # [Errno 13]". None named the uid, nor what to do.
  config = _dataset(user_dir / "data")
  path = shut_out(config)
  run = _serve(config, cwd=user_dir, as_user=True)
  lines = run.stderr.strip().splitlines()
  assert run.returncode != 0, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert len(lines) == 1, run.stderr
  (line,) = lines
  assert line.startswith("elevator: error: "), line
  assert repr(path) in line and f"uid {UID}" in line, line
  assert "chmod" in line and "--user" in line, line


def test_a_readable_dataset_still_loads_as_that_user(user_dir: pathlib.Path) -> None:
  """The check refuses only what the user may not read: the same layout,
  readable, is described by that user (embedded mode reads the config and
  opens the shards as the server does; its workers are not started, since
  here multiprocessing's helpers cannot exec this venv's Python as uid
  10001, whatever the data's modes)."""
  config = _dataset(user_dir / "data")
  run = subprocess.run([*AS_USER, *ELEVATOR, "describe", f"local:{config}"],
                       capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=user_dir)
  assert run.returncode == 0, run.stdout + run.stderr
  assert '"x"' in run.stdout, run.stdout + run.stderr


# Makes `import jax` fail as it does where JAX is not installed.
_NO_JAX = '''
import sys

class _NoJax:
  def find_spec(self, name, path=None, target=None):
    if name == "jax" or name.startswith("jax."):
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None

sys.meta_path.insert(0, _NoJax())
'''
_JAX_PROFILER_WARNING = "Failed to load jax profiler"


def _without(module_source: str, folder: pathlib.Path) -> dict[str, str]:
  """An environment whose Pythons run `module_source` first (a sitecustomize)."""
  folder.mkdir()
  (folder / "sitecustomize.py").write_text(module_source)
  return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder),
                                                       os.environ.get("PYTHONPATH")]))}


def test_no_jax_profiler_warning_where_jax_is_absent(tmp_path: pathlib.Path,
                                                     config_path: str) -> None:
  # Before: "WARNING:absl:Failed to load jax profiler: No module named 'jax'"
  # twice at every start, once from the supervisor, once from the fork server.
  env = _without(_NO_JAX, tmp_path / "nojax")
  run = _serve(pathlib.Path(config_path), cwd=tmp_path, env=env, idle_exit_s=0.5)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "elevator: serving" in run.stdout, run.stdout + run.stderr
  assert _JAX_PROFILER_WARNING not in run.stderr, run.stderr


def test_a_broken_jax_still_warns(tmp_path: pathlib.Path) -> None:
  """Only JAX's absence is quiet: a JAX that fails to import (here its
  jaxlib missing) is still said, by the same import the server makes."""
  env = _without(_NO_JAX.replace('"jax"', '"jaxlib"').replace('"jax."', '"jaxlib."'),
                 tmp_path / "nojaxlib")
  run = subprocess.run(
      [sys.executable, "-c", "import grain_elevator.server.data.config, grain"],
      capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=tmp_path,
      env={**os.environ, **env})
  assert run.returncode == 0, run.stderr
  assert _JAX_PROFILER_WARNING in run.stderr, run.stderr
