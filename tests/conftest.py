"""Shared fixtures: a small real dataset, its config, and real `elevator serve`
processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Iterator

import pytest

from grain_elevator.server import examples

ELEVATOR = [sys.executable, "-m", "grain_elevator.server.cli"]
IMAGE = {"height": 4, "width": 4, "channels": 3}
NUM_RECORDS = 1000

CONFIG = textwrap.dedent("""\
    [datasets.aug2]          # random transform, shuffled, 2 epochs
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.server.examples:decode_and_augment"
    seed = 7
    num_epochs = 2
    [datasets.aug2.options]
    height = 4
    width = 4
    channels = 3

    [datasets.plain]         # no shuffle, 1 epoch
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.server.examples:decode_images"
    shuffle = false
    [datasets.plain.options]
    height = 4
    width = 4
    channels = 3

    [datasets.seed3]         # shuffled, 1 epoch, another seed, float images
    paths = ["shards/train-0000[0-1]*.array_record", "shards/train-00002*"]
    pipeline = "grain_elevator.server.examples:decode_images"
    seed = 3
    [datasets.seed3.options]
    height = 4
    width = 4
    channels = 3
    normalize = true

    [datasets.forever]       # repeats forever
    paths = ["shards/*.array_record"]
    pipeline = "grain_elevator.server.examples:decode_images"
    seed = 11
    num_epochs = 0
    [datasets.forever.options]
    height = 4
    width = 4
    channels = 3

    [datasets.raw]           # no pipeline: raw record bytes
    paths = ["shards/*.array_record"]
    seed = 5
    """)

DATASETS = ("aug2", "plain", "seed3", "forever", "raw")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("elevator-data")
  examples.write_image_shards(str(root / "shards"), num_records=NUM_RECORDS,
                              num_shards=3, **IMAGE)
  (root / "elevator.toml").write_text(CONFIG)
  return root


@pytest.fixture(scope="session")
def config_path(data_dir: pathlib.Path) -> str:
  return str(data_dir / "elevator.toml")


class ServerProcess:
  """A real `elevator serve` child process."""

  def __init__(self, config: str, workers: int = 2, port: int = 0,
               extra: tuple[str, ...] = ()):
    self.proc = subprocess.Popen(
        ELEVATOR + ["serve", "--config", config, "--host", "127.0.0.1",
                    "--port", str(port), "--workers", str(workers), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.stderr_lines: list[str] = []
    threading.Thread(target=self._drain_stderr, daemon=True).start()
    line = self.proc.stdout.readline()
    match = re.search(r" on ([\d.]+):(\d+) ", line)
    if not match:
      self.proc.kill()
      self.proc.wait()
      raise RuntimeError(f"server did not start: {line!r}\n{self.stderr()}")
    self.port = int(match.group(2))
    self.target = f"127.0.0.1:{self.port}"

  def _drain_stderr(self) -> None:
    for line in self.proc.stderr:
      self.stderr_lines.append(line)

  def stderr(self) -> str:
    return "".join(self.stderr_lines)

  def stop(self, timeout: float = 30) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def running_server(config: str, **kwargs) -> Iterator[ServerProcess]:
  server = ServerProcess(config, **kwargs)
  try:
    yield server
  finally:
    server.stop()


@pytest.fixture(scope="session")
def server(config_path: str) -> Iterator[ServerProcess]:
  """One 2-worker server shared by the whole session."""
  with running_server(config_path, workers=2) as s:
    yield s
  assert s.proc.returncode == 0, s.stderr()


@pytest.fixture(scope="session")
def oracle(config_path: str):
  """Embedded mode: the in-process contract every service test compares to."""
  from grain_elevator.client.embedded import EmbeddedBackend
  return EmbeddedBackend(config_path)
