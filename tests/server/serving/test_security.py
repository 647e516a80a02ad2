"""TLS, mutual TLS and bearer tokens: each failure gets its precise status.

The TLS servers are the session's in-process ones (`serve`); the token's
is an `elevator serve` process, whose log the tests read for the token (an
in-process server's workers log where no test can read)."""

from __future__ import annotations

import pathlib
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grain_elevator.client import (RemoteDataset, RetryPolicy, Security,
                                   ServiceUnavailableError, UnauthenticatedError)
from grain_elevator.server import Server
from grain_elevator.tools.testing.launcher import ELEVATOR, LocalServer
from helpers import assert_trees_equal, oracle_batch

TOKEN = "s3cret-token-for-tests"
QUICK = RetryPolicy(timeout_s=0.5)  # these fail at the handshake: no need to wait


def _openssl(*args: str, cwd: pathlib.Path) -> None:
  subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: pathlib.Path, name: str) -> None:
  _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
           "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _cert(d: pathlib.Path, name: str, ca: str, ext: str) -> None:
  _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
           f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
  (d / f"{name}.ext").write_text(ext)
  _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
           "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
           f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> pathlib.Path:
  d = tmp_path_factory.mktemp("pki")
  _ca(d, "ca")
  _ca(d, "other-ca")
  _cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
  _cert(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
  (d / "token").write_text(TOKEN + "\n")
  return d


def _read(d: pathlib.Path, name: str) -> bytes:
  return (d / name).read_bytes()


@pytest.fixture(scope="module")
def token_server(config_path, pki):
  with LocalServer(config_path, workers=1,
                   extra_args=("--auth-token-file", str(pki / "token"))) as s:
    yield s


def test_right_token_serves(token_server, oracle):
  with RemoteDataset(token_server.target, "plain", 16,
                     security=Security(auth_token=TOKEN)) as ds:
    assert_trees_equal(next(iter(ds)), oracle_batch(oracle, "plain", 0, 16))


@pytest.mark.parametrize("token,message", [
    (None, "missing bearer token"), ("guess", "wrong bearer token")])
def test_missing_or_wrong_token_is_unauthenticated(token_server, token, message):
  with pytest.raises(UnauthenticatedError, match=message) as info:
    iter(RemoteDataset(token_server.target, "plain", 16,
                       security=Security(auth_token=token)))
  assert TOKEN not in str(info.value)
  assert TOKEN not in token_server.stderr()


def test_health_needs_no_token_on_the_health_port(token_server, elevator):
  code, out, _ = elevator("health", token_server.health_target)
  assert code == 0 and "SERVING" in out


def test_health_on_the_grpc_port_needs_the_token(token_server, elevator):
  # Probes belong on the health port; a connection to the gRPC port that
  # makes no call with the token is closed soon (server/serving/front_door.py).
  code, _, err = elevator("health", token_server.target)
  assert code == 1 and "UNAUTHENTICATED" in err and "missing bearer token" in err
  with grpc.insecure_channel(token_server.target) as channel:
    check = health_pb2_grpc.HealthStub(channel).Check
    answer = check(health_pb2.HealthCheckRequest(), timeout=10,
                   metadata=Security(auth_token=TOKEN).metadata)
  assert answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def tls_server(serve, pki: pathlib.Path) -> Server:
  return serve(workers=1, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))


@pytest.fixture(scope="module")
def mtls_server(serve, pki: pathlib.Path) -> Server:
  return serve(workers=1, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
               tls_client_ca=str(pki / "ca.pem"))


def test_tls_with_the_right_ca(tls_server, pki, oracle):
  with RemoteDataset(tls_server.target, "plain", 16,
                     security=Security(root_certificates=_read(pki, "ca.pem"))) as ds:
    assert_trees_equal(next(iter(ds)), oracle_batch(oracle, "plain", 0, 16))


def test_tls_with_a_wrong_ca_is_refused(tls_server, pki):
  with pytest.raises(ServiceUnavailableError, match="UNAVAILABLE"):
    iter(RemoteDataset(tls_server.target, "plain", 16, retry=QUICK,
                       security=Security(root_certificates=_read(pki, "other-ca.pem"))))


def test_plaintext_client_cannot_talk_to_tls(tls_server):
  with pytest.raises(ServiceUnavailableError, match="UNAVAILABLE"):
    iter(RemoteDataset(tls_server.target, "plain", 16, retry=QUICK))


def test_mtls_without_a_client_certificate_is_refused(mtls_server, pki):
  with pytest.raises(ServiceUnavailableError, match="UNAVAILABLE"):
    iter(RemoteDataset(mtls_server.target, "plain", 16, retry=QUICK,
                       security=Security(root_certificates=_read(pki, "ca.pem"))))


def test_mtls_with_a_client_certificate(mtls_server, pki, oracle):
  with RemoteDataset(mtls_server.target, "plain", 16, security=Security.from_files(
      root_certificates=str(pki / "ca.pem"), private_key=str(pki / "client.key"),
      certificate_chain=str(pki / "client.pem"))) as ds:
    assert_trees_equal(next(iter(ds)), oracle_batch(oracle, "plain", 0, 16))


@pytest.mark.parametrize("args,message", [
    (("--tls-cert", "x.pem"), "--tls-cert and --tls-key go together"),
    (("--tls-client-ca", "ca.pem"), "--tls-client-ca needs --tls-cert"),
])
def test_bad_security_flags(config_path, args, message, elevator):
  """Refused with the options, before anything starts."""
  code, _, err = elevator("serve", "--config", config_path, "--port", "0", *args)
  assert code == 2 and message in err


@pytest.mark.slow  # an `elevator serve` process
def test_a_missing_token_file_is_refused(config_path):
  """Refused as the server starts (the file is read then): the process's own exit."""
  result = subprocess.run([*ELEVATOR, "serve", "--config", config_path, "--port", "0",
                           "--auth-token-file", "/nonexistent/token"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "--auth-token-file '/nonexistent/token'" in result.stderr
