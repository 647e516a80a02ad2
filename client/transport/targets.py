"""The target grammar: how a trainer names the servers it reads from.

  "host:port"            one replica (IPv6 as "[::1]:port")
  ["host:port", ...]     several replicas with the same config
  "dns:///name:port"     every address the name resolves to (a headless
                         Service): gRPC balances over them, and the bulk
                         transport opens connections to each
  other gRPC URIs        "ipv4:", "ipv6:", "unix:", "unix-abstract:" (gRPC only)
  "local:CONFIG_PATH"    embedded mode: the config's pipeline in-process
"""

from __future__ import annotations

import socket
from typing import Sequence

from grain_elevator.proto.errors import InvalidRequestError

LOCAL_PREFIX = "local:"
URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", LOCAL_PREFIX)


def parse_targets(target: str | Sequence[str]) -> list[str]:
  """Validates "host:port" targets (or the URIs above); InvalidRequestError
  naming a bad one."""
  targets = [target] if isinstance(target, str) else list(target)
  if not targets:
    raise InvalidRequestError(f"target must be 'host:port' or a list of them, got {target!r}")
  for t in targets:
    if not isinstance(t, str):
      raise InvalidRequestError(f"target must be 'host:port' or a list of them, got {target!r}")
    if t.startswith(URI_SCHEMES):
      continue
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise InvalidRequestError(f"target {t!r} is not 'host:port' (e.g. 'localhost:50051')")
  local = [t for t in targets if t.startswith(LOCAL_PREFIX)]
  if local and len(targets) != 1:
    raise InvalidRequestError(f"'local:CONFIG' cannot be mixed with other targets: {targets}")
  return targets


def local_config(targets: Sequence[str]) -> str | None:
  """The config path of a "local:CONFIG_PATH" target (parsed), else None."""
  if len(targets) == 1 and targets[0].startswith(LOCAL_PREFIX):
    return targets[0][len(LOCAL_PREFIX):]
  return None


def local_target(config_path: str) -> str:
  return f"{LOCAL_PREFIX}{config_path}"


def bulk_hosts(target: str) -> list[str]:
  """The replica addresses behind a target, for bulk connections: the host of
  "host:port"; every address a "dns:///name:port" name resolves to now (a
  headless Service); none for other gRPC URIs (those use gRPC)."""
  if target.startswith("dns:"):
    name = target[len("dns:"):].lstrip("/").rpartition("/")[2]
    host = name.rpartition(":")[0] or name
    try:
      infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
      return []
    return sorted({info[4][0] for info in infos})
  if target.startswith(URI_SCHEMES):
    return []
  host = target.rpartition(":")[0]
  return [host[1:-1] if host.startswith("[") else host]


def replica_name(replica: tuple[str, str] | None) -> str:
  """How a warning names a replica: its target, and its address if the
  target is a name for several."""
  if replica is None:
    return "a replica"
  target, host = replica
  return target if host in (target, target.rpartition(":")[0].strip("[]")) else (
      f"{host} (behind {target})")
