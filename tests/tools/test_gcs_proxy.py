"""The documented way to try the server against gcp-storage-emulator
(docs/buckets.md, "GCS emulators"): the emulator speaks GCS's JSON API, the
server reads GCS through its XML API, and `python -m
grain_elevator.tools.testing.fault_proxy --gcs-xml` translates. The command
is run as a user runs it; the listing is the server's own config loading."""

from __future__ import annotations

import pathlib
import re
import selectors
import signal
import subprocess
import sys
from typing import Iterator

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.process import lifeline
from grain_elevator.tools.testing import storage_servers
import datasets
from datasets import IMAGE

pytestmark = pytest.mark.slow  # two servers in subprocesses (the emulator, the proxy)

COMMAND = (sys.executable, "-m", "grain_elevator.tools.testing.fault_proxy")
BUCKET = "elevator-proxy"
START_TIMEOUT_S = 60  # the proxy's first line: ~0.3 s measured here


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[storage_servers.GcsServer]:
  """gcp-storage-emulator holding two image shards under data/."""
  try:
    server = storage_servers.GcsServer()
  except storage_servers.ServerUnavailable as e:
    pytest.skip(f"gcp-storage-emulator cannot run here ({e}); `make test` installs it "
                "with the [test] extra")
  try:
    server.create_bucket(BUCKET)
    shards = tmp_path_factory.mktemp("proxy-shards")
    examples.write_image_shards(str(shards), num_records=20, num_shards=2, **IMAGE)
    for shard in sorted(shards.glob("*.array_record")):
      server.put(BUCKET, f"data/{shard.name}", shard.read_bytes())
    yield server
  finally:
    server.stop()


@pytest.fixture
def proxy(emulator: storage_servers.GcsServer) -> Iterator[str]:
  """The documented command in front of the emulator; its URL, from the
  line it prints first."""
  proc = subprocess.Popen(lifeline.tied([*COMMAND, "--gcs-xml", emulator.url]),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    with selectors.DefaultSelector() as sel:
      sel.register(proc.stdout, selectors.EVENT_READ)
      ready = sel.select(START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    found = re.match(r"STORAGE_EMULATOR_HOST=(http://127\.0\.0\.1:\d+)\s", line)
    assert found, f"no URL in the proxy's first line {line!r}"
    yield found.group(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _config(tmp_path: pathlib.Path) -> str:
  # A short retry budget: the failing listing gives up in a second, not 30.
  return datasets.write_config(tmp_path / "elevator.toml",
                               img=datasets.images(f"gs://{BUCKET}/data/*.array_record",
                                                   storage={"retry_s": 1}))


def test_the_command_lets_the_server_list_the_emulators_bucket(
    proxy: str, emulator: storage_servers.GcsServer, tmp_path: pathlib.Path) -> None:
  # env(): STORAGE_EMULATOR_HOST, and a throwaway key, since the test process
  # holds GOOGLE_SERVICE_ACCOUNT_KEY empty (tests/stable_environ.py), which
  # obstore would read as a broken key; a user's shell has none.
  with storage_servers.environment(emulator.env(proxy)):
    config = config_lib.load_config(_config(tmp_path))
  assert config.datasets["img"].files == (
      f"gs://{BUCKET}/data/train-00000-of-00002.array_record",
      f"gs://{BUCKET}/data/train-00001-of-00002.array_record")


def test_the_emulator_alone_cannot_be_listed(emulator: storage_servers.GcsServer,
                                            tmp_path: pathlib.Path) -> None:
  """What docs/buckets.md says: pointed at gcp-storage-emulator itself, the
  server's listing fails (the emulator answers GCS's XML list with JSON).
  Should a release of the emulator serve the XML API, this fails and the
  docs should say it works directly."""
  with storage_servers.environment(emulator.env()), \
      pytest.raises(ConfigError, match=rf"dataset 'img': cannot list gs://{BUCKET}/data/"):
    config_lib.load_config(_config(tmp_path))


@pytest.mark.parametrize("upstream", ["https://127.0.0.1:9023", "127.0.0.1:9023",
                                      "http://127.0.0.1:9023/storage", "http://h:port"])
def test_a_wrong_upstream_is_refused_naming_it(upstream: str) -> None:
  run = subprocess.run([*COMMAND, "--gcs-xml", upstream], capture_output=True, text=True,
                       timeout=START_TIMEOUT_S)
  assert run.returncode == 2, run.stdout + run.stderr
  assert "argument upstream" in run.stderr and repr(upstream) in run.stderr, run.stderr
