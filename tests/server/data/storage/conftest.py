"""Object-storage servers for the bucket tests: moto's S3 server and
gcp-storage-emulator, started once per session on 127.0.0.1 (skipped, with
the reason, where the [test] extra did not install them), each behind a
fault-injecting proxy (tools/testing/fault_proxy.py)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Iterator

import pytest

from grain_elevator.server.data.storage import read_ahead
from grain_elevator.tools.testing import storage_servers
from grain_elevator.tools.testing.fault_proxy import FaultProxy

BUCKET = "elevator-data"


@dataclasses.dataclass
class Bucket:
  """A bucket on a live server, behind a proxy; `url(key)` names an object."""

  kind: str  # "s3" or "gcs"
  server: Any
  proxy: FaultProxy
  bucket: str = BUCKET

  @property
  def scheme(self) -> str:
    return "s3" if self.kind == "s3" else "gs"

  def url(self, key: str) -> str:
    return f"{self.scheme}://{self.bucket}/{key}"

  def env(self) -> dict[str, str]:
    return self.server.env(self.proxy.url)

  def put(self, key: str, data: bytes) -> None:
    self.server.put(self.bucket, key, data)

  def upload(self, folder: pathlib.Path, prefix: str) -> None:
    for f in sorted(folder.glob("*.array_record")):
      self.put(f"{prefix}/{f.name}", f.read_bytes())


def _start(kind: str) -> Any:
  try:
    return storage_servers.S3Server() if kind == "s3" else storage_servers.GcsServer()
  except storage_servers.ServerUnavailable as e:
    pytest.skip(f"the {kind} server cannot run here ({e}); `make test` installs it "
                "with the [test] extra")


@pytest.fixture(scope="session", params=["s3", "gcs"])
def bucket(request) -> Iterator[Bucket]:
  server = _start(request.param)
  try:
    server.create_bucket(BUCKET)
    with FaultProxy(server.url, gcs_xml=request.param == "gcs") as proxy:
      yield Bucket(request.param, server, proxy)
  finally:
    server.stop()


@pytest.fixture(autouse=True)
def _no_faults_left(request) -> Iterator[None]:
  """Each test starts and ends with a proxy that forwards everything."""
  if "bucket" not in request.fixturenames:
    yield
    return
  b = request.getfixturevalue("bucket")
  b.proxy.clear()
  b.proxy.latency_s = 0.0
  b.proxy.stall_s = 5.0
  b.proxy.faults_only_for = None
  yield
  b.proxy.clear()


@pytest.fixture(autouse=True)
def _fresh_read_ahead() -> Iterator[None]:
  """Each test's embedded reads start with an empty read-ahead: what an
  earlier test planned and never read is not this test's."""
  read_ahead.configure(read_ahead.DEFAULT_READ_AHEAD_BYTES)
  yield
