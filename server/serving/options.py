"""How a server runs: every knob of `elevator serve`, in one frozen dataclass.

Each field is one option, with one name: `ServerOptions(grace_s=20)` in
Python is `--grace-s 20` on the command line. Its default and its help live
in the field alone; `add_arguments` makes the CLI's flags from them and
`from_arguments` reads them back, so the two cannot drift (a test checks).
The checks run on construction, so a server started either way refuses the
same mistakes with the same message.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.storage.read_ahead import DEFAULT_READ_AHEAD_MB
from grain_elevator.server.serving import cgroup
from grain_elevator.server.serving.admission import STALL_GRACE_S

# A host's rows for one step are one message; bounded so that no request
# (G = 10^9, say) makes a worker allocate without limit. Embedded mode keeps
# the same bound, so it refuses what a server refuses.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# A stream dataset's global batch is made whole for its hosts (G rows, however
# few a request asks for), so G itself is bounded: a packed LLM batch of
# 4,096 rows of 8,192 int32 tokens, ids and positions is 384 MiB.
DEFAULT_MAX_STREAM_BATCH_BYTES = 512 << 20
# gRPC threads beyond the request slots, and the health service's own pool:
# probes answer while every slot is held by requests.
HEALTH_THREADS = 4
# The default batch cache (server/serving/batch_cache.py): this fraction of
# the container's memory limit, at most DEFAULT_BATCH_CACHE_CAP, shared by
# the workers.
BATCH_CACHE_MEMORY_FRACTION = 1 / 16
DEFAULT_BATCH_CACHE_CAP = 512 << 20
# The words a tri-state `bool | None` option takes on the command line.
_TRI_STATE = {"auto": None, "on": True, "off": False}


def _option(default: Any, help: str, *, none: str = "none",  # pylint: disable=redefined-builtin
            metavar: str | None = None) -> Any:
  """A field of ServerOptions: its default and its help. `none` is what the
  CLI calls the value None ("auto", "off", "never"), and accepts for it."""
  return dataclasses.field(default=default,
                           metadata={"help": help, "none": none, "metavar": metavar})


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """Options of one server (all its worker processes).

  Every field is documented by its help text, which `elevator serve --help`
  prints with its default.
  """

  host: str = _option("127.0.0.1", "address to listen on; 0.0.0.0 for every interface")
  port: int = _option(50051, "the gRPC port; 0 picks a free one (the ready line and "
                             "Server.port say which)")
  workers: int | None = _option(
      None, "worker processes sharing the port; auto: one per usable CPU (affinity, "
            "capped by the container's cgroup CPU limit)", none="auto")
  threads: int | None = _option(
      None, "gRPC handler threads of one worker; must exceed --max-concurrent-requests, "
            f"so that a Describe finds a thread while every slot is held; auto: "
            f"--max-concurrent-requests + {HEALTH_THREADS}", none="auto")
  grace_s: float = _option(5.0, "seconds requests in flight get to finish on shutdown")
  max_concurrent_requests: int = _option(
      16, "requests (Describe, GetBatches; both transports) one worker serves at once; "
          "more are answered RESOURCE_EXHAUSTED and clients back off; health checks "
          "are not counted")
  max_message_bytes: int = _option(
      DEFAULT_MAX_MESSAGE_BYTES, "largest batch message (one host's rows of one step), checked "
                 "before any record is read")
  max_stream_batch_bytes: int = _option(
      DEFAULT_MAX_STREAM_BATCH_BYTES, "largest global batch (G rows, every host's) of a stream "
      "dataset, which a worker makes whole however few rows a request asks for; checked "
      "before any record is read")
  write_timeout_s: float = _option(
      30.0, "a request whose client has not taken a batch for this long is cancelled "
            "and its slot freed; when every slot is taken, one stalled over "
            f"{STALL_GRACE_S:g} s yields to a newcomer sooner")
  idle_timeout_s: float = _option(
      300.0, "a connection with no request for this long is closed (clients reconnect "
             "on their next request without an error)")
  max_bulk_connections: int = _option(
      1024, "bulk connections one worker keeps open; past it the longest-idle one is "
            "closed to admit the newcomer")
  max_grpc_connections: int = _option(
      1024, "gRPC connections one worker accepts; past it new ones are closed at once "
            "and the client tries another worker or replica")
  max_streams_per_connection: int = _option(
      32, "calls one gRPC connection carries at once (HTTP/2 MAX_CONCURRENT_STREAMS); "
          "a client queues the rest itself")
  tls_cert: str | None = _option(None, "PEM certificate chain file: serve TLS (gRPC only)",
                                 metavar="PEM")
  tls_key: str | None = _option(None, "PEM private key file of --tls-cert", metavar="PEM")
  tls_client_ca: str | None = _option(
      None, "PEM CA bundle file: require client certificates it signed (mutual TLS)",
      metavar="PEM")
  auth_token_file: str | None = _option(
      None, "file holding the bearer token every call on the gRPC and bulk ports must "
            "carry, health's on the gRPC port included (the health port needs none); a "
            "gRPC connection that makes no call with it is closed soon after it opens",
      metavar="FILE")
  bulk: bool | None = _option(
      None, "the bulk transport: batches over plain TCP at a fraction of gRPC's CPU cost "
            "per byte; auto: offered unless TLS is on; on: required (an error with "
            "TLS, since it is plaintext); off: clients use gRPC", none="auto")
  bulk_port: int = _option(0, "the bulk transport's port; 0 picks a free one, advertised "
                              "to clients in Describe")
  metrics_port: int | None = _option(
      None, "serve Prometheus metrics of the whole server at http://HOST:PORT/metrics; "
            "0 picks a free one", none="off")
  health_port: int = _option(
      0, "the health port: grpc.health.v1.Health (Check, List, Watch) for probes and load "
         "balancers, on connections of its own, reached by no load on the other ports; "
         "answers for the whole server; 0 picks a free one (the ready line says which)")
  max_bulk_connections_per_peer: int = _option(
      128, "bulk connections one client address keeps open on one worker; past it that "
           "address's longest-idle one is closed to admit its newcomer, or the newcomer "
           "if none is idle")
  idle_exit_s: float | None = _option(
      None, "exit 0 once no request (health checks aside) has been in flight for this "
            "many seconds: a data tier started for one job ends with it", none="never")
  batch_cache_mb: int | None = _option(
      None, "MiB of recently served steps the workers keep (split evenly), so that "
            "trainers reading the same stream get each step produced once, and as much "
            "again for stream datasets' global batches shared by their hosts; 0: off; "
            "auto: 1/16 of the container's memory limit, at most 512", none="auto")
  read_ahead_mb: int = _option(
      DEFAULT_READ_AHEAD_MB, "MiB each worker may hold of bucket reads made ahead of their "
      "steps (a request's steps and the next ones it will be asked for, docs/buckets.md); "
      "0: off, each step reads its own ranges when made")
  cache_dir: str | None = _option(
      None, "a folder on this machine's disks where the server keeps the bucket objects it "
            "serves, filled once in 8 MiB ranges and kept across restarts; records it holds "
            "are read locally (docs/buckets.md); one server per folder", none="off",
      metavar="DIR")
  cache_mb: int | None = _option(
      None, "MiB the cache may hold at most; full, it serves what it holds and the rest is "
            "read by plan; auto: what it holds plus nine tenths of its disk's free space at start",
      none="auto")

  def __post_init__(self) -> None:
    for name in ("port", "bulk_port", "metrics_port", "health_port"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < 65536:
        raise ConfigError(f"{name} must be in [0, 65536), got {value}")
    for name in ("max_concurrent_requests", "max_message_bytes", "max_stream_batch_bytes",
                 "max_bulk_connections", "max_grpc_connections", "max_streams_per_connection",
                 "max_bulk_connections_per_peer"):
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
    if self.read_ahead_mb < 0:
      raise ConfigError(f"read_ahead_mb must be >= 0, got {self.read_ahead_mb}")
    if self.cache_mb is not None and self.cache_mb < 0:
      raise ConfigError(f"cache_mb must be >= 0, got {self.cache_mb}")
    if self.cache_mb is not None and not self.cache_dir:
      raise ConfigError("--cache-mb needs --cache-dir")
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
    if self.tls and (self.bulk or self.bulk_port):
      raise ConfigError(
          "the bulk transport (--bulk, --bulk-port) serves plaintext and cannot be "
          "combined with TLS (--tls-cert); TLS clients use gRPC")

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


# -- the same fields as command-line flags ---------------------------------------------


def flag(name: str) -> str:
  """The flag of field `name`: max_concurrent_requests -> --max-concurrent-requests."""
  return "--" + name.replace("_", "-")


def _parser_of(kind: Any, none: str):
  """A parser of one flag's text for a field of type `kind` (int, float, str,
  bool, optionally | None, whose text is the word `none`)."""
  args = typing.get_args(kind)
  optional = type(None) in args
  base = next((a for a in args if a is not type(None)), kind) if args else kind
  if base is bool:
    def tri_state(text: str) -> bool | None:
      if text not in _TRI_STATE:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_TRI_STATE)}, "
                                         f"got {text!r}")
      return _TRI_STATE[text]
    return tri_state

  def parse(text: str) -> Any:
    if optional and text == none:
      return None
    try:
      return base(text)
    except ValueError:
      expected = {int: "a whole number", float: "a number"}.get(base, "a value")
      raise argparse.ArgumentTypeError(
          f"expected {expected}{f' or {none!r}' if optional else ''}, got {text!r}") from None
  return parse


def _shown(value: Any, none: str) -> str:
  if value is None:
    return none
  if isinstance(value, bool):
    return next(word for word, v in _TRI_STATE.items() if v is value)
  return f"{value:g}" if isinstance(value, float) else str(value)


def _metavar(kind: Any, meta: Any) -> str | None:
  args = typing.get_args(kind)
  if meta["metavar"]:
    return meta["metavar"]
  if bool in args:
    return "|".join(_TRI_STATE)
  if kind in (int, float) or int in args or float in args:
    return f"N|{meta['none']}" if type(None) in args else "N"
  return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """One flag per field of ServerOptions, its help and default from the field."""
  hints = typing.get_type_hints(ServerOptions)
  for field in dataclasses.fields(ServerOptions):
    kind, meta = hints[field.name], field.metadata
    parser.add_argument(
        flag(field.name), dest=field.name, type=_parser_of(kind, meta["none"]),
        default=field.default, metavar=_metavar(kind, meta),
        help=f"{meta['help']} (default: {_shown(field.default, meta['none'])})")


def from_arguments(args: argparse.Namespace) -> ServerOptions:
  """The ServerOptions that `add_arguments`' flags were given."""
  return ServerOptions(**{f.name: getattr(args, f.name)
                          for f in dataclasses.fields(ServerOptions)})
