"""Shared fixtures: a small real dataset, its config, and real `elevator serve`
processes on 127.0.0.1."""

from __future__ import annotations

import os

# 8 CPU devices for the mesh tests; must be set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib
import textwrap
from typing import Iterator

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.tools.testing.launcher import LocalServer
import stable_environ

stable_environ.declare()  # before any thread starts: tests/stable_environ.py

IMAGE = {"height": 4, "width": 4, "channels": 3}
NUM_RECORDS = 1000

CONFIG = textwrap.dedent("""\
    [datasets.aug2]          # random transform, shuffled, 2 epochs
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_and_augment"
    seed = 7
    num_epochs = 2
    [datasets.aug2.options]
    height = 4
    width = 4
    channels = 3

    [datasets.plain]         # no shuffle, 1 epoch
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    shuffle = false
    [datasets.plain.options]
    height = 4
    width = 4
    channels = 3

    [datasets.seed3]         # shuffled, 1 epoch, another seed, float images
    paths = ["shards/train-0000[0-1]*.array_record", "shards/train-00002*"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 3
    [datasets.seed3.options]
    height = 4
    width = 4
    channels = 3
    normalize = true

    [datasets.seed3fast]     # seed3 with a whole-batch decode: identical rows
    paths = ["shards/train-*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    batch_transform = "grain_elevator.pipelines.examples:decode_images_batch"
    seed = 3
    [datasets.seed3fast.options]
    height = 4
    width = 4
    channels = 3
    normalize = true

    [datasets.forever]       # repeats forever
    paths = ["shards/*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 11
    num_epochs = 0
    [datasets.forever.options]
    height = 4
    width = 4
    channels = 3

    [datasets.raw]           # no pipeline: raw record bytes
    paths = ["shards/*.array_record"]
    seed = 5

    [datasets.eval]          # evaluation mode: every record once, the last batch padded
    paths = ["shards/*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 13
    drop_remainder = false
    [datasets.eval.options]
    height = 4
    width = 4
    channels = 3
    """)

DATASETS = ("aug2", "plain", "seed3", "seed3fast", "forever", "raw", "eval")


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


@pytest.fixture(scope="session")
def server(config_path: str) -> Iterator[LocalServer]:
  """One 2-worker server shared by the whole session."""
  with LocalServer(config_path, workers=2) as s:
    yield s


@pytest.fixture(scope="session")
def few_config(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> str:
  """A stream dataset, "few": the images of three labels (a filter,
  examples.decode_some), repeating forever."""
  path = tmp_path_factory.mktemp("few") / "elevator.toml"
  path.write_text(textwrap.dedent(f"""\
      [datasets.few]
      paths = ["{data_dir}/shards/*.array_record"]
      pipeline = "grain_elevator.pipelines.examples:decode_some"
      seed = 41
      num_epochs = 0
      [datasets.few.options]
      height = 4
      width = 4
      channels = 3
      labels = [1, 3, 4]
      """))
  return str(path)


# "big": a stream dataset of rows of about 3 KiB (32x32x3 images, a filter
# keeping 9 labels of 10), repeating forever: memory under pressure shows.
BIG_SIDE = 32


@pytest.fixture(scope="session")
def big_config(tmp_path_factory: pytest.TempPathFactory) -> str:
  root = tmp_path_factory.mktemp("big")
  examples.write_image_shards(str(root / "shards"), num_records=600, num_shards=2,
                              height=BIG_SIDE, width=BIG_SIDE, channels=3)
  (root / "elevator.toml").write_text(textwrap.dedent(f"""\
      [datasets.big]
      paths = ["shards/*.array_record"]
      pipeline = "grain_elevator.pipelines.examples:decode_some"
      seed = 5
      num_epochs = 0
      [datasets.big.options]
      height = {BIG_SIDE}
      width = {BIG_SIDE}
      channels = 3
      labels = [0, 1, 2, 3, 4, 5, 6, 7, 8]
      """))
  return str(root / "elevator.toml")


@pytest.fixture(scope="session")
def oracle(config_path: str):
  """Embedded mode: the in-process contract every service test compares to."""
  from grain_elevator.client.embedded import EmbeddedBackend
  return EmbeddedBackend(config_path)


def pytest_report_header() -> str:
  """Which Grain the contract is checked against (`make test-grain-lowest`
  puts another first on the path)."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import grain  # pylint: disable=g-import-not-at-top
  return f"grain {importlib.metadata.version('grain')} ({os.path.dirname(grain.__file__)})"


def pytest_terminal_summary(terminalreporter) -> None:
  late = stable_environ.late_names()
  if late:
    terminalreporter.write_line(
        f"environment variables added after start-up (declare them in "
        f"tests/stable_environ.py): {', '.join(late)}", red=True)


# Forks of this process: it runs gRPC's and JAX's threads, so a fork can hang
# in the child or leave the parent's gRPC stuck, and every later test with it.
# What must fork (a torch DataLoader's workers) runs in a subprocess.
_forks: list[int] = []
os.register_at_fork(after_in_parent=lambda: _forks.append(os.getpid()))


@pytest.fixture(autouse=True)
def _no_fork_of_the_test_process() -> Iterator[None]:
  before = len(_forks)
  yield
  if len(_forks) != before:
    pytest.fail("the test forked the pytest process (os.fork, a fork-start "
                "multiprocessing pool, a DataLoader's workers): run that part in a subprocess")
