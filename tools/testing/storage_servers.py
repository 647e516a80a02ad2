"""Object-storage servers on 127.0.0.1 for the tests and the storage bench.

`S3Server` runs moto's server mode and `GcsServer` gcp-storage-emulator,
each a subprocess of this Python on a free port, tied to this process
(server/process/lifeline.py `tied`: it dies with it); both come from PyPI
with the [test] extra. `FaultProxy` (fault_proxy.py) goes in front of either.
Nothing here reaches beyond 127.0.0.1.

gcp-storage-emulator speaks GCS's JSON API; object_store (obstore) reads GCS
through its XML API, which the emulator implements only for plain GETs. The
proxy's `gcs_xml` mode answers the XML calls obstore makes (list, HEAD, a
GET's ETag, Last-Modified and generation headers, If-Match) from the
emulator's JSON metadata: see fault_proxy.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

from grain_elevator.server.process import lifeline

# Where a server must answer within, once started (moto imports for ~3 s on
# a loaded 2-core machine).
START_TIMEOUT_S = 60.0


# The variables `env()` of each server gives a client (tests declare them:
# tests/stable_environ.py).
ENV_NAMES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
             "STORAGE_EMULATOR_HOST", "GOOGLE_SERVICE_ACCOUNT_KEY")


class ServerUnavailable(RuntimeError):
  """The server's package is not installed or it did not start."""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
  """This process's environment with `env` set (a store's endpoint and
  keys, which a server's workers and obstore read as they start), then as
  it was."""
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def end(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
  """Stops a server subprocess: SIGTERM, then SIGKILL past `grace_s`."""
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(grace_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(grace_s)


def _wait_http(url: str, proc: subprocess.Popen, log_path: str) -> None:
  deadline = time.monotonic() + START_TIMEOUT_S
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      with open(log_path, errors="replace") as f:
        raise ServerUnavailable(
            f"{proc.args[:3]} exited with {proc.returncode}: {f.read()[-2000:]}")
    try:
      urllib.request.urlopen(url, timeout=2).close()
      return
    except urllib.error.HTTPError:
      return  # it answers
    except OSError:
      time.sleep(0.1)
  proc.kill()
  raise ServerUnavailable(f"{url} did not answer within {START_TIMEOUT_S:.0f}s")


def _request(method: str, url: str, data: bytes | None = None,
             headers: dict[str, str] | None = None) -> bytes:
  req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
  with urllib.request.urlopen(req, timeout=60) as r:
    return r.read()


class _Subprocess:
  """A server subprocess with its log in a temporary folder."""

  def __init__(self, argv: list[str], probe_path: str, env: dict[str, str] | None = None):
    self.port = free_port()
    self._dir = tempfile.mkdtemp(prefix="elevator-storage-")
    self._log_path = os.path.join(self._dir, "server.log")
    argv = [a.replace("{port}", str(self.port)) for a in argv]
    self._log = open(self._log_path, "wb")
    self.proc = subprocess.Popen(lifeline.tied(argv), stdout=self._log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=self._dir,
                                 env={**os.environ, **env} if env else None)
    _wait_http(self.url + probe_path, self.proc, self._log_path)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def stop(self) -> None:
    end(self.proc)
    self._log.close()
    shutil.rmtree(self._dir, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


class S3Server(_Subprocess):
  """moto's S3 server. Any access key pair is accepted, unless `checks_keys`:
  then every request must be signed by a key moto's IAM knows, and none is
  (what a wrong key meets). Buckets are created with `create_bucket`."""

  ACCESS_KEY = "elevator-test-key"
  SECRET_KEY = "elevator-test-secret-0123456789"

  def __init__(self, checks_keys: bool = False):
    try:
      import moto.server  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError as e:
      raise ServerUnavailable(f"moto[server] is not installed: {e}") from e
    super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"],
                     "/moto-api/", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if checks_keys
                     else None)

  def _client(self) -> Any:
    """boto3 (moto's own dependency): moto refuses an unsigned overwrite."""
    import boto3  # pylint: disable=g-import-not-at-top
    return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=self.ACCESS_KEY,
                        aws_secret_access_key=self.SECRET_KEY, region_name="us-east-1")

  def create_bucket(self, bucket: str) -> None:
    self._client().create_bucket(Bucket=bucket)

  def put(self, bucket: str, key: str, data: bytes) -> None:
    self._client().put_object(Bucket=bucket, Key=key, Body=data)

  def delete(self, bucket: str, key: str) -> None:
    self._client().delete_object(Bucket=bucket, Key=key)

  def env(self, endpoint: str | None = None) -> dict[str, str]:
    """The standard AWS variables a client needs for this server (or for a
    proxy in front of it, at `endpoint`)."""
    return {"AWS_ENDPOINT_URL": endpoint or self.url, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_REGION": "us-east-1"}


class GcsServer(_Subprocess):
  """gcp-storage-emulator, in memory. Buckets are created with `create_bucket`."""

  def __init__(self):
    exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable))
    if exe is None:
      raise ServerUnavailable("gcp-storage-emulator is not installed")
    super().__init__([exe, "start", "--host", "127.0.0.1", "--port", "{port}", "--in-memory"],
                     "/")
    self._key: str | None = None

  def create_bucket(self, bucket: str) -> None:
    _request("POST", f"{self.url}/storage/v1/b", json.dumps({"name": bucket}).encode(),
             {"Content-Type": "application/json"})

  def put(self, bucket: str, key: str, data: bytes) -> None:
    name = urllib.parse.quote(key, safe="")
    _request("POST", f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
             data, {"Content-Type": "application/octet-stream"})

  def delete(self, bucket: str, key: str) -> None:
    _request("DELETE", f"{self.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")

  def env(self, endpoint: str | None = None) -> dict[str, str]:
    """The emulator's host, and a service-account key of this server's own:
    obstore's GCS client wants a bearer token to write even where it reads
    unsigned, and with `disable_oauth` it signs one itself from the key, so
    no token endpoint (which the emulator lacks) is asked."""
    return {"STORAGE_EMULATOR_HOST": endpoint or self.url,
            "GOOGLE_SERVICE_ACCOUNT_KEY": self._service_account_key()}

  def _service_account_key(self) -> str:
    if self._key is None:
      from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top
      from cryptography.hazmat.primitives.asymmetric import rsa  # pylint: disable=g-import-not-at-top
      pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
          serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
          serialization.NoEncryption()).decode()
      self._key = json.dumps({"private_key": pem, "private_key_id": "emulator",
                              "client_email": "tests@emulator.iam.gserviceaccount.com",
                              "disable_oauth": True})
    return self._key
