"""The client's options, grouped as Grain groups its own: frozen dataclasses.

    RemoteDataset(target, "train", 1024)                                  # defaults
    RemoteDataset(target, "train", 1024, security=Security(auth_token=t))
    RemoteDataset(target, "train", 1024,
                  transport=TransportOptions(kind="grpc"),
                  retry=RetryPolicy(timeout_s=300))

They live here, beside the transport that reads them, so that the
transport imports nothing above it; users import them from
`grain_elevator.client` (or client/options.py, which re-exports them). The
two defaults the pool sizes itself by live here too; client/window.py plans
the window from them.
"""

from __future__ import annotations

import dataclasses
import pathlib


from grain_elevator.proto import wire
from grain_elevator.proto.errors import InvalidRequestError

# The most the default window holds (received and not yet taken, or coming);
# `RemoteDataset(window_bytes=...)` sets another, and the pool sizes its
# receive buffers to it (pool.py). 512 MiB holds 2 requests of 3 steps of the
# bench's 4.9 MB "large" batch for each of 16 workers (96 steps): at 256 MiB
# the default kept 0.83x of the tuned rate there (BENCHMARKS.md, "A default
# client against the tuned one").
WINDOW_BYTES = 512 << 20
# Requests in flight a default client aims for on each server worker: one
# being produced while the batch of the other is sent, so no worker waits a
# round trip for its next request. Also the connections per worker of a
# default pool (`TransportOptions.connections_per_target` None).
REQUESTS_PER_WORKER = 2

TRANSPORT_KINDS = ("auto", "grpc", "bulk")

@dataclasses.dataclass(frozen=True)
class TransportOptions:
  """How batches travel.

  Attributes:
    kind: "auto": the server's bulk transport (plain TCP, a fraction of
      gRPC's CPU cost per byte) where it offers one that can be reached,
      else gRPC; "grpc": always gRPC; "bulk": require the bulk transport.
      Batches are bit-identical either way; TLS means gRPC.
    connections_per_target: TCP connections per replica, spread over its
      worker processes. A bulk connection carries one request at a time, so
      this also bounds the requests in flight. None (the default): sized
      from each replica's worker count, which its first connection reports:
      REQUESTS_PER_WORKER per worker (one request being produced
      while the other's batch is sent), one per worker for a stream
      dataset (its requests go one at a time: client/stream_iterator.py).
    steps_per_request: consecutive steps asked for in one request; None
      (the default): about request_size.REQUEST_S of a server worker's
      time, as the servers report it, and at most about
      window.REQUEST_BYTES of steps (client/request_size.py,
      client/window.py). The window is topped up a whole request at a
      time; each step reaches the trainer as soon as it arrives.
    compression: "none", or "zstd": the server compresses each tensor of
      wire.MIN_COMPRESSED_BYTES or more (proto/wire.py). Costs CPU on both ends; pays only on a network slower
      than the codec (not on loopback or a fast datacenter link).
    dns_refresh_s: how often the bulk transport asks DNS again who is
      behind a "dns:///name:port" target (it also asks before each
      reconnect). gRPC re-resolves by itself; bulk connections are plain
      sockets, so without this a rolling update (pods replaced, the name
      now pointing elsewhere) would leave them dialling addresses that are
      gone. New addresses get connections; those that left are retired
      after their current request.
  """

  kind: str = "auto"
  connections_per_target: int | None = None
  steps_per_request: int | None = None
  compression: str = "none"
  dns_refresh_s: float = 30.0

  def __post_init__(self) -> None:
    if self.kind not in TRANSPORT_KINDS:
      raise InvalidRequestError(f"transport kind must be one of {', '.join(TRANSPORT_KINDS)}, "
                       f"got {self.kind!r}")
    if self.compression not in wire.COMPRESSIONS:
      raise InvalidRequestError(f"compression must be one of {', '.join(wire.COMPRESSIONS)}, "
                       f"got {self.compression!r}")
    if (self.connections_per_target is not None and self.connections_per_target < 1) or (
        self.steps_per_request is not None and self.steps_per_request < 1):
      raise InvalidRequestError("need connections_per_target >= 1 (or None: sized from the "
                                "servers' workers) and steps_per_request >= 1 (or None: sized "
                                "from the step)")
    if not self.dns_refresh_s > 0:
      raise InvalidRequestError(f"need dns_refresh_s > 0, got {self.dns_refresh_s}")

  def check_security(self, security: "Security") -> None:
    """Raises unless these options can run with `security`."""
    if self.kind == "bulk" and security.tls:
      raise InvalidRequestError("the bulk transport is plaintext: use transport kind 'grpc' "
                       "(or 'auto') with TLS")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """When to try again, and when to give up.

  A request that fails with a retriable status (UNAVAILABLE,
  DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, a server's CANCELLED) is
  sent again for its remaining steps to another connection or replica,
  after a capped, jittered exponential backoff. A connection that failed is
  shunned (its replica is tried last) for `shun_initial_s`, doubling per
  consecutive failure up to `shun_max_s`, so a dead or frozen replica costs
  one deadline, not one per request. RESOURCE_EXHAUSTED means the replica
  is full right now: the retry goes to another replica, or where there is
  none and the request came over the bulk transport (kind "auto"), over
  gRPC; a rate-limited warning says so. A replica that sends a batch
  breaking the element spec or its size bound is shunned for `shun_max_s`
  and the step asked of another; DataLossError once every replica did.

  Attributes:
    timeout_s: give up with ServiceUnavailableError after this long without
      a step arriving.
    request_timeout_s: deadline of one request; over the bulk transport the
      longest wait for data.
    connect_timeout_s: opening a connection and asking a replica what it
      offers (a frozen host accepts, then hangs).
    initial_backoff_s, max_backoff_s: the backoff between attempts.
    shun_initial_s, shun_max_s: how long a failing replica is avoided.
  """

  timeout_s: float = 60.0
  request_timeout_s: float = 120.0
  connect_timeout_s: float = 5.0
  initial_backoff_s: float = 0.05
  max_backoff_s: float = 2.0
  shun_initial_s: float = 0.5
  shun_max_s: float = 30.0

  def __post_init__(self) -> None:
    for field in dataclasses.fields(self):
      if getattr(self, field.name) <= 0:
        raise InvalidRequestError(f"RetryPolicy.{field.name} must be > 0, "
                         f"got {getattr(self, field.name)}")

  def backoff_cap(self, attempt: int) -> float:
    """The most to wait before attempt `attempt + 1` (jitter takes half to all)."""
    return min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)

  def shun_s(self, failures: int) -> float:
    """How long a replica is avoided after `failures` consecutive failures."""
    return min(self.shun_max_s, self.shun_initial_s * 2**(failures - 1))


@dataclasses.dataclass(frozen=True)
class Security:
  """TLS material (bytes, as `grpc.ssl_channel_credentials` takes them) and a
  bearer token. Any TLS field turns TLS on (and with it, gRPC only)."""

  root_certificates: bytes | None = None
  private_key: bytes | None = None
  certificate_chain: bytes | None = None
  auth_token: str | None = dataclasses.field(default=None, repr=False)

  @classmethod
  def from_files(cls, *, root_certificates: str | None = None,
                 private_key: str | None = None, certificate_chain: str | None = None,
                 auth_token_file: str | None = None) -> "Security":
    """The same, read from PEM files and a token file (as the server takes them)."""
    def read(path: str | None) -> bytes | None:
      return pathlib.Path(path).read_bytes() if path else None
    token = pathlib.Path(auth_token_file).read_text().strip() if auth_token_file else None
    return cls(read(root_certificates), read(private_key), read(certificate_chain), token)

  @property
  def tls(self) -> bool:
    return any((self.root_certificates, self.private_key, self.certificate_chain))

  @property
  def metadata(self) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else None
