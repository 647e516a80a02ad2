"""Shared fixtures: a small real dataset, its config, and real `elevator serve`
processes on 127.0.0.1."""

from __future__ import annotations

import os

# 8 CPU devices for the mesh tests; must be set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import logging
import pathlib
from typing import Any, Callable, Iterator

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools.testing.launcher import LocalServer
import datasets
import durations
from datasets import IMAGE  # pylint: disable=unused-import (the shards' image size, for tests)
import stable_environ

stable_environ.declare()  # before any thread starts: tests/stable_environ.py

NUM_RECORDS = 1000

CONFIG = datasets.config_text(
    # a random transform, shuffled, 2 epochs
    aug2=datasets.images("shards/train-*.array_record", pipeline=datasets.AUGMENT, seed=7,
                         num_epochs=2),
    # no shuffle, 1 epoch
    plain=datasets.images("shards/train-*.array_record", shuffle=False),
    # shuffled, 1 epoch, another seed, float images
    seed3=datasets.images(["shards/train-0000[0-1]*.array_record", "shards/train-00002*"],
                          seed=3, options={"normalize": True}),
    # seed3's records decoded a whole batch at once: rows identical to its
    # decode of each record
    seed3fast=datasets.images("shards/train-*.array_record", seed=3,
                              batch_transform="grain_elevator.pipelines.examples:decode_images_batch",
                              options={"normalize": True}),
    forever=datasets.images(seed=11, num_epochs=0),  # repeats forever
    raw=datasets.raw(seed=5),  # no pipeline: raw record bytes
    # evaluation mode: every record once, the last batch padded
    eval=datasets.images(seed=13, drop_remainder=False),
)

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


# `make test-grain-lowest` checks Grain's semantics on the lowest Grain
# admitted in embedded mode alone: the servers run the same code (the
# main run compares them with embedded mode), so starting them again proves
# nothing about Grain. There `server` and `serve` give embedded targets, and
# a test that starts a server itself is skipped.
EMBEDDED_ONLY = os.environ.get("ELEVATOR_EMBEDDED_ONLY") == "1"


@dataclasses.dataclass(frozen=True)
class EmbeddedTarget:
  """Where the embedded-only pass reads what a server would serve."""
  config: str

  @property
  def target(self) -> str:
    return f"local:{self.config}"


@pytest.fixture(scope="session")
def server(config_path: str) -> Iterator[LocalServer | EmbeddedTarget]:
  """One 2-worker `elevator serve` shared by the whole session."""
  if EMBEDDED_ONLY:
    yield EmbeddedTarget(config_path)
    return
  with LocalServer(config_path, workers=2) as s:
    yield s


@pytest.fixture(scope="session")
def serve(config_path: str) -> Iterator[Callable[..., Server | EmbeddedTarget]]:
  """In-process servers shared by the session, one per distinct config and
  options, stopped at its end: `serve(config=config_path, workers=1,
  **ServerOptions fields)`. For tests that only read from a server; a test
  that signals one, kills its workers or reads its log starts its own."""
  started: dict[tuple[str, tuple[tuple[str, Any], ...]], Server] = {}

  def get(config: str | os.PathLike[str] | None = None, **options: Any
          ) -> Server | EmbeddedTarget:
    path = str(config or config_path)
    if EMBEDDED_ONLY:
      return EmbeddedTarget(path)
    options = {"port": 0, "workers": 1, **options}
    key = (path, tuple(sorted(options.items())))
    if key not in started:
      started[key] = Server(path, ServerOptions(**options)).start()
    return started[key]

  yield get
  for s in started.values():
    s.stop()


def _skip_in_the_embedded_only_pass(*args: Any, **kwargs: Any) -> None:
  pytest.skip("the lowest-Grain pass runs embedded mode only (ELEVATOR_EMBEDDED_ONLY)")


if EMBEDDED_ONLY:  # a test, or a fixture of any scope, that starts a server is skipped
  LocalServer.__init__ = _skip_in_the_embedded_only_pass
  Server.start = _skip_in_the_embedded_only_pass


@pytest.fixture(scope="session")
def few_config(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> str:
  """A stream dataset, "few": the images of three labels (a filter,
  examples.decode_some), repeating forever."""
  return datasets.write_config(
      tmp_path_factory.mktemp("few") / "elevator.toml",
      few=datasets.images(data_dir / datasets.SHARDS, pipeline=datasets.DECODE_SOME, seed=41,
                          num_epochs=0, options={"labels": [1, 3, 4]}))


# "big": a stream dataset of rows of about 3 KiB (32x32x3 images, a filter
# keeping 9 labels of 10), repeating forever: memory under pressure shows.
BIG_SIDE = 32


@pytest.fixture(scope="session")
def big_config(tmp_path_factory: pytest.TempPathFactory) -> str:
  root = tmp_path_factory.mktemp("big")
  examples.write_image_shards(str(root / "shards"), num_records=600, num_shards=2,
                              height=BIG_SIDE, width=BIG_SIDE, channels=3)
  return datasets.write_config(
      root / "elevator.toml",
      big=datasets.images(pipeline=datasets.DECODE_SOME, seed=5, num_epochs=0,
                          image={"height": BIG_SIDE, "width": BIG_SIDE, "channels": 3},
                          options={"labels": list(range(9))}))


@pytest.fixture(scope="session")
def oracle(config_path: str):
  """Embedded mode: the in-process contract every service test compares to."""
  from grain_elevator.client.embedded import EmbeddedBackend
  return EmbeddedBackend(config_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Test files in the order of the seconds they took (tests/durations.py),
  longest first, each file's tests together and in their own order."""
  seconds = durations.load()
  root = pathlib.Path(__file__).resolve().parent.parent
  first_seen: dict[str, int] = {}
  for item in items:
    first_seen.setdefault(str(item.path.relative_to(root)), len(first_seen))
  items.sort(key=lambda item: (-seconds.get(str(item.path.relative_to(root)), 0.0),
                               first_seen[str(item.path.relative_to(root))]))


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


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
  """Puts grain_elevator's logger back as the test found it: a test that runs
  the CLI in this process (cli.main) has logs.setup replace its handlers and
  stop its propagation, which would hide every later test's logs from caplog
  in the same pytest worker."""
  logger = logging.getLogger("grain_elevator")
  handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
  yield
  logger.handlers[:] = handlers
  logger.setLevel(level)
  logger.propagate = propagate


@pytest.fixture
def grain_elevator_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
  """caplog at INFO for grain_elevator's loggers: the client's, and an
  in-process server's supervisor thread (which worker died, which serves
  again)."""
  logging.getLogger("grain_elevator").propagate = True  # put back after (above)
  caplog.set_level(logging.INFO, logger="grain_elevator")
  return caplog


@pytest.fixture
def elevator(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
             ) -> Callable[..., tuple[int, str, str]]:
  """`elevator ARGV` as the command runs it (cli.main), in this process rather
  than a fresh interpreter (~3 s of imports), for commands that must start no
  server (a refused flag, a client command): its exit code, stdout and
  stderr. This process's logging is left alone; a server start fails the
  test."""
  from grain_elevator import server as server_lib  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.process import logs, supervisor  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools import cli  # pylint: disable=g-import-not-at-top

  def started(*given: object, **named: object) -> None:
    raise AssertionError(f"elevator serve started a server: {given} {named}")
  monkeypatch.setattr(logs, "setup", lambda *given, **named: None)
  monkeypatch.setattr(supervisor, "serve", started)
  monkeypatch.setattr(server_lib, "serve", started, raising=False)

  def run(*argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
  return run
