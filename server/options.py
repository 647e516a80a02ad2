"""How a server runs: every knob of `elevator serve`, in one frozen dataclass.

The CLI's flags and the Python API (`grain_elevator.server.Server`) both
build a `ServerOptions`, and its checks run on construction, so a server
started either way refuses the same mistakes with the same message.
"""

from __future__ import annotations

import dataclasses

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server import cgroup

# A host's rows for one step are one message; bounded so that no request
# (G = 10^9, say) makes a worker allocate without limit.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# The default batch cache (server/batch_cache.py): this fraction of the
# container's memory limit, at most DEFAULT_BATCH_CACHE_CAP, shared by the workers.
BATCH_CACHE_MEMORY_FRACTION = 1 / 16
DEFAULT_BATCH_CACHE_CAP = 512 << 20
# gRPC threads beyond the request slots, and the health service's own pool:
# probes answer while every slot is held by requests.
HEALTH_THREADS = 4


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """Options of one server (all its worker processes).

  Attributes:
    host: address to listen on; "0.0.0.0" for every interface.
    port: the gRPC port; 0 picks a free one (`Server.port` says which).
    workers: worker processes sharing the port; None: one per usable CPU
      (affinity, capped by the container's cgroup CPU limit: server/cgroup.py).
    threads: gRPC handler threads of one worker; None: max_concurrent_requests
      + HEALTH_THREADS. Must exceed max_concurrent_requests, so that a
      health check or Describe finds a thread while every slot is held.
    grace_s: seconds requests in flight get to finish on shutdown.
    max_concurrent_requests: requests (Describe, GetBatches; both transports)
      one worker accepts at once; more are answered RESOURCE_EXHAUSTED and
      clients back off. Health checks are not counted.
    max_message_bytes: largest batch message (one host's rows of one step),
      checked before any record is read.
    write_timeout_s: a request whose client has not taken a batch for this
      long is cancelled and its slot freed (server/admission.py); when every
      slot is taken, one stalled over a second yields to a newcomer sooner.
    idle_timeout_s: a connection with no request for this long is closed
      (bulk: by the server's loop; gRPC: max_connection_idle). Clients
      reconnect on their next request without an error.
    max_bulk_connections: bulk connections one worker keeps open; past it
      the longest-idle one is closed to admit the newcomer.
    max_grpc_connections: gRPC connections one worker accepts (gRPC's
      max_allowed_incoming_connections); past it new ones are closed at
      once, and the client tries another worker or replica. Idle ones are
      closed after idle_timeout_s, silent ones after the handshake timeout.
    max_streams_per_connection: calls one gRPC connection carries at once
      (HTTP/2 MAX_CONCURRENT_STREAMS); a client queues the rest itself.
    tls_cert, tls_key: PEM files: serve TLS (gRPC only).
    tls_client_ca: PEM CA bundle: require client certificates it signed.
    auth_token_file: file holding the bearer token every request must carry.
    bulk: the bulk transport (plain TCP, a fraction of gRPC's CPU cost per
      byte). None: offered unless TLS is on; True: required (an error with
      TLS, since it is plaintext); False: off.
    bulk_port: its port; 0 picks a free one, advertised in Describe.
    idle_exit_s: `serve` stops and exits 0 once no request (health checks
      aside) has been in flight for this long: a data tier started for one job ends
      with it. None: never.
    metrics_port: serve Prometheus metrics of the whole server at
      http://host:metrics_port/metrics (server/metrics.py); 0 picks a free
      one; None: no metrics.
    batch_cache_mb: MiB of recently served steps the workers keep (split
      evenly), so that trainers reading the same stream get each step
      produced once (server/batch_cache.py); 0: off. None: 1/16 of the
      container's memory limit (server/cgroup.py), at most 512 MiB.
  """

  host: str = "127.0.0.1"
  port: int = 50051
  workers: int | None = None
  threads: int | None = None
  grace_s: float = 5.0
  max_concurrent_requests: int = 16
  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
  write_timeout_s: float = 30.0
  idle_timeout_s: float = 300.0
  max_bulk_connections: int = 1024
  max_grpc_connections: int = 1024
  max_streams_per_connection: int = 32
  tls_cert: str | None = None
  tls_key: str | None = None
  tls_client_ca: str | None = None
  auth_token_file: str | None = None
  bulk: bool | None = None
  bulk_port: int = 0
  metrics_port: int | None = None
  idle_exit_s: float | None = None
  batch_cache_mb: int | None = None

  def __post_init__(self) -> None:
    for name in ("port", "bulk_port", "metrics_port"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < 65536:
        raise ConfigError(f"{name} must be in [0, 65536), got {value}")
    for name in ("max_concurrent_requests", "max_message_bytes", "max_bulk_connections",
                 "max_grpc_connections", "max_streams_per_connection"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.threads is not None and self.threads <= self.max_concurrent_requests:
      raise ConfigError(
          f"threads ({self.threads}) must exceed max_concurrent_requests "
          f"({self.max_concurrent_requests}): a gRPC request holds a thread while it "
          "runs, and health checks need one free; leave threads unset for "
          f"max_concurrent_requests + {HEALTH_THREADS}")
    if self.idle_exit_s is not None and not self.idle_exit_s > 0:
      raise ConfigError(f"idle_exit_s must be > 0, got {self.idle_exit_s}")
    for name in ("write_timeout_s", "idle_timeout_s"):
      if not getattr(self, name) > 0:
        raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
    if self.batch_cache_mb is not None and self.batch_cache_mb < 0:
      raise ConfigError(f"batch_cache_mb must be >= 0, got {self.batch_cache_mb}")
    if self.workers is not None and self.workers < 1:
      raise ConfigError(f"workers must be >= 1, got {self.workers}")
    if self.grace_s < 0:
      raise ConfigError(f"grace_s must be >= 0, got {self.grace_s}")
    if bool(self.tls_cert) != bool(self.tls_key):
      raise ConfigError("--tls-cert and --tls-key go together")
    if self.tls_client_ca and not self.tls_cert:
      raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if self.bulk and self.tls:
      raise ConfigError(
          "the bulk transport (--bulk-port) serves plaintext and cannot be combined "
          "with TLS (--tls-cert); TLS clients use gRPC")

  @property
  def grpc_threads(self) -> int:
    return self.threads or self.max_concurrent_requests + HEALTH_THREADS

  @property
  def tls(self) -> bool:
    return bool(self.tls_cert)

  @property
  def serves_bulk(self) -> bool:
    return self.bulk is not False and not self.tls

  @property
  def num_workers(self) -> int:
    return self.workers or cgroup.usable_cpus()

  @property
  def batch_cache_bytes(self) -> int:
    """The whole server's batch cache budget, in bytes."""
    if self.batch_cache_mb is not None:
      return self.batch_cache_mb << 20
    return min(DEFAULT_BATCH_CACHE_CAP,
               int(cgroup.memory_bytes() * BATCH_CACHE_MEMORY_FRACTION))
