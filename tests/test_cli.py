"""`elevator describe` against a real server and a local config."""

from __future__ import annotations

import json
import subprocess

import pytest

from grain_elevator.tools.launcher import ELEVATOR


@pytest.mark.parametrize("local", [False, True])
def test_describe(server, config_path, local):
  target = f"local:{config_path}" if local else server.target
  result = subprocess.run([*ELEVATOR, "describe", target, "--dataset", "aug2", "-G", "96"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  (info,) = json.loads(result.stdout)
  assert info["name"] == "aug2" and info["num_records"] == 1000
  assert (info["steps_per_epoch"], info["total_steps"]) == (10, 20)
  assert {"path": "image", "dtype": "uint8", "shape": [4, 4, 3]} in info["element_spec"]


def test_describe_unknown_dataset(server):
  result = subprocess.run([*ELEVATOR, "describe", server.target, "--dataset", "nope"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "elevator: error: unknown dataset 'nope'" in result.stderr


def test_health(server):
  result = subprocess.run([*ELEVATOR, "health", server.target],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0 and "SERVING" in result.stdout
  result = subprocess.run([*ELEVATOR, "health", "127.0.0.1:1", "--timeout", "1"],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


@pytest.mark.slow  # writes 10,000 records in a subprocess
@pytest.mark.parametrize("fmt", ["tfds", "arrayrecord"])
def test_make_dataset_writes_a_servable_config(tmp_path, fmt):
  result = subprocess.run([*ELEVATOR, "make-dataset", str(tmp_path), "--source", "generated",
                           "--format", fmt],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  result = subprocess.run([*ELEVATOR, "describe", f"local:{tmp_path}/elevator.toml"],
                          capture_output=True, text=True, timeout=120)
  (info,) = json.loads(result.stdout)
  assert info["name"] == "generated" and info["num_records"] == 10_000
