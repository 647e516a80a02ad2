"""docker-compose.yml as the README runs it: it writes the demo dataset, serves
it on 127.0.0.1:50051 (bulk: 50052, health: 50053) bit-identical to embedded
mode, and comes down cleanly. `docker compose` (v2) where installed, else `docker-compose`
(v1, what Debian packages). Skipped, with the reason, without a Docker
engine, a compose command, a local base image, or free ports 50051-50053."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import ROOT, assert_streams_equal

pytestmark = pytest.mark.slow

BASES = ("elevator-base:bookworm", "python:3.11-slim")


def _run(args: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


def _compose() -> list[str]:
  try:
    if _run(["docker", "info"], timeout=30).returncode:
      pytest.skip("no Docker engine answers here (start dockerd to run this)")
  except (OSError, subprocess.TimeoutExpired) as e:
    pytest.skip(f"no Docker client or engine: {e}")
  if _run(["docker", "compose", "version"]).returncode == 0:
    return ["docker", "compose"]
  if shutil.which("docker-compose"):
    return ["docker-compose"]
  pytest.skip("neither `docker compose` (v2) nor `docker-compose` (v1) is installed")


def _port_free(port: int) -> bool:
  with socket.socket() as s:
    return s.connect_ex(("127.0.0.1", port)) != 0


def test_compose_up_serves_the_demo_dataset_and_comes_down(tmp_path):
  compose = _compose()
  base = os.environ.get("ELEVATOR_BASE_IMAGE") or next(
      (b for b in BASES if _run(["docker", "image", "inspect", b]).returncode == 0), None)
  if base is None:
    pytest.skip(f"none of {', '.join(BASES)} is present: build one with "
                "deploy/build-base-image.sh")
  if not all(map(_port_free, (50051, 50052, 50053))):
    pytest.skip("one of 127.0.0.1:50051-50053 is taken; compose publishes those")
  # The README's steps, in a copy of the checkout so ./demo-data is the test's.
  work = tmp_path / "checkout"
  shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(
      ".venv*", ".git", "build", "*.egg-info", "demo-data", "__pycache__", "*.so"))
  (work / "demo-data").mkdir()
  env = {**os.environ, "UID": str(os.getuid()), "BASE_IMAGE": base}
  project = ["-p", f"elevatortest{os.getpid()}"]
  up = _run([*compose, *project, "up", "-d", "--build"], timeout=1800, cwd=work, env=env)
  try:
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    deadline = time.monotonic() + 180
    while _run([*ELEVATOR, "health", "127.0.0.1:50053"]).returncode:
      assert time.monotonic() < deadline, _run([*compose, *project, "logs"], cwd=work,
                                               env=env).stdout[-3000:]
      time.sleep(1)
    config = work / "demo-data" / "elevator.toml"
    assert config.exists() and os.stat(config).st_uid == os.getuid()
    with RemoteDataset("127.0.0.1:50051", "generated", 64) as remote, \
         RemoteDataset.embedded(str(config), "generated", 64) as local:
      it = iter(remote)
      assert it._backend.uses_bulk  # pylint: disable=protected-access
      got = [next(it) for _ in range(30)]
      want = iter(local)
      assert assert_streams_equal(got, [next(want) for _ in range(30)]) == 30
  finally:
    down = _run([*compose, *project, "down", "-t", "20"], timeout=120, cwd=work, env=env)
  assert down.returncode == 0, down.stderr[-3000:]
  assert _port_free(50051)
