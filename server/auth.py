"""Bearer-token authentication for every service but health.

Health stays open so load balancers and kubelet probes need no secret. The
token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import pathlib
from typing import Any, Callable

import grpc

from grain_elevator.server.errors import ConfigError

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token(path: str) -> str:
  try:
    token = pathlib.Path(path).read_text().strip()
  except OSError as e:
    raise ConfigError(f"--auth-token-file {path!r}: {e.strerror}") from e
  if not token:
    raise ConfigError(f"--auth-token-file {path!r} is empty")
  return token


def _denied(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
  def abort(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
    del request_or_iterator
    context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

  kind: Callable[..., grpc.RpcMethodHandler]
  if handler.request_streaming and handler.response_streaming:
    kind = grpc.stream_stream_rpc_method_handler
  elif handler.request_streaming:
    kind = grpc.stream_unary_rpc_method_handler
  elif handler.response_streaming:
    kind = grpc.unary_stream_rpc_method_handler
  else:
    kind = grpc.unary_unary_rpc_method_handler
  return kind(abort, request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)


class BearerTokenInterceptor(grpc.ServerInterceptor):
  """Requires `authorization: Bearer <token>` metadata."""

  def __init__(self, token: str):
    self._expected = f"Bearer {token}".encode()

  def intercept_service(self, continuation, handler_call_details):
    if handler_call_details.method.startswith(OPEN_PREFIXES):
      return continuation(handler_call_details)
    metadata = dict(handler_call_details.invocation_metadata or ())
    got = metadata.get("authorization", "")
    if isinstance(got, bytes):
      got = got.decode(errors="replace")
    if hmac.compare_digest(got.encode(), self._expected):
      return continuation(handler_call_details)
    handler = continuation(handler_call_details)
    if handler is None:
      return None
    why = ("missing bearer token (authorization metadata)" if not got
           else "wrong bearer token")
    return _denied(handler, why)


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
