"""The container image, built and run: it serves the embedded-mode stream bit
for bit and stops cleanly. Needs a Docker engine and a local base image
(no registry is assumed): skipped, with the reason, where either is missing.

    sudo deploy/build-base-image.sh            # elevator-base:bookworm
    ELEVATOR_BASE_IMAGE=elevator-base:bookworm pytest tests/deploy/test_docker.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import ROOT, assert_streams_equal

pytestmark = pytest.mark.slow

TAG = "grain-elevator:test"
BASES = ("elevator-base:bookworm", "python:3.11-slim")


def _docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
  result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
  if check and result.returncode:
    raise AssertionError(f"docker {' '.join(args)} failed:\n{result.stdout[-3000:]}"
                         f"{result.stderr[-3000:]}")
  return result


@pytest.fixture(scope="module")
def image() -> str:
  try:
    if _docker("info", check=False, timeout=30).returncode:
      pytest.skip("no Docker engine answers here (start dockerd to run this)")
  except (OSError, subprocess.TimeoutExpired) as e:
    pytest.skip(f"no Docker client or engine: {e}")
  wanted = os.environ.get("ELEVATOR_BASE_IMAGE")
  bases = (wanted,) if wanted else BASES
  base = next((b for b in bases
               if _docker("image", "inspect", b, check=False).returncode == 0), None)
  if base is None:
    pytest.skip(f"none of {', '.join(bases)} is present and no registry is assumed: "
                "build one with deploy/build-base-image.sh")
  _docker("build", "--network", "host", "-f", "deploy/Dockerfile",
          "--build-arg", f"BASE_IMAGE={base}", "-t", TAG, str(ROOT), timeout=1800)
  return TAG


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_the_image_serves_the_embedded_stream_and_stops_cleanly(image, tmp_path):
  data = tmp_path / "data"
  subprocess.run([*ELEVATOR, "make-dataset", str(data), "--source", "generated",
                  "--format", "arrayrecord"], check=True, capture_output=True, timeout=300)
  os.chmod(tmp_path, 0o755)
  for path in [data, *data.rglob("*")]:  # the image runs as uid 10001
    os.chmod(path, 0o755 if path.is_dir() else 0o644)
  assert _docker("image", "inspect", "-f", "{{.Config.User}}", image).stdout.strip() == (
      "10001:10001")
  port, bulk, metrics, health = _free_port(), _free_port(), _free_port(), _free_port()
  name = f"elevator-test-{os.getpid()}"
  # Locked down as deploy/k8s/elevator.yaml runs it: read-only root with a
  # /tmp of its own, no capabilities, no privilege gain, and a CPU limit of
  # one that `--workers auto` must read from the container's cgroup.
  _docker("run", "-d", "--name", name, "--network", "host", "-v", f"{data}:/data:ro",
          "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
          "--security-opt", "no-new-privileges", "--cpus", "1",
          "-e", f"ELEVATOR_HEALTH_TARGET=127.0.0.1:{health}", image,
          "serve", "--config", "/data/elevator.toml", "--host", "127.0.0.1",
          "--port", str(port), "--bulk-port", str(bulk), "--metrics-port", str(metrics),
          "--health-port", str(health), "--workers", "auto")
  try:
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while subprocess.run([*ELEVATOR, "health", f"127.0.0.1:{health}"], capture_output=True,
                         timeout=30).returncode:
      assert time.monotonic() < deadline, _docker("logs", name).stderr[-3000:]
      time.sleep(1)
    with RemoteDataset(target, "generated", 64) as remote, \
         RemoteDataset.embedded(str(data / "elevator.toml"), "generated", 64) as local:
      it = iter(remote)
      assert it._backend.uses_bulk  # pylint: disable=protected-access
      got = [next(it) for _ in range(40)]
      want = iter(local)
      assert assert_streams_equal(got, [next(want) for _ in range(40)]) == 40
    with socket.create_connection(("127.0.0.1", metrics), timeout=10):
      pass  # the metrics port answers from inside the container
    assert "with 1 worker processes" in _docker("logs", name).stdout
    _docker("stop", "-t", "20", name, timeout=60)
    code = _docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    assert code == "0", _docker("logs", name).stderr[-3000:]
    assert "elevator: stopped" in _docker("logs", name).stdout
  finally:
    _docker("rm", "-f", name, check=False)
