"""The server's secrets, read from the operator's files: TLS and the token.

Files are read when the server starts (a missing or empty one stops it with
a ConfigError naming the flag); where the token is checked is the request
path's business (server/serving/request_path.py).
"""

from __future__ import annotations

import pathlib

import grpc

from grain_elevator.proto.errors import ConfigError


def read_token(path: str) -> str:
  try:
    token = pathlib.Path(path).read_text().strip()
  except OSError as e:
    raise ConfigError(f"--auth-token-file {path!r}: {e.strerror}") from e
  if not token:
    raise ConfigError(f"--auth-token-file {path!r} is empty")
  return token


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
  """TLS, and mutual TLS when `client_ca` is given."""
  def read(path: str, flag: str) -> bytes:
    try:
      return pathlib.Path(path).read_bytes()
    except OSError as e:
      raise ConfigError(f"{flag} {path!r}: {e.strerror}") from e
  ca = read(client_ca, "--tls-client-ca") if client_ca else None
  return grpc.ssl_server_credentials(
      [(read(key, "--tls-key"), read(cert, "--tls-cert"))],
      root_certificates=ca, require_client_auth=ca is not None)
