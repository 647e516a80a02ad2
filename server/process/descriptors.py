"""A worker's file descriptor budget: what it may hold open, stated and secured.

A worker holds at most: one socket per bulk connection and per gRPC
connection (each port capped, ServerOptions), up to two descriptors per shard
(the checked file and the reader's own), and a fixed reserve for listeners,
pipes, epoll and eventfds, logs and the metrics directory. The soft
RLIMIT_NOFILE is raised to that total where the hard limit allows; where it
does not, the worker says so at start, and past the limit new connections
are refused (each port backs off and logs once a period) while those open
go on.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import resource

log = logging.getLogger("grain_elevator.server")
# Listeners, wake-up pipes, gRPC's epoll and eventfds, the lifeline and
# result pipes, log and metrics files, libraries: ~40 measured on a worker
# at rest; the rest is headroom.
RESERVED_DESCRIPTORS = 128
DESCRIPTORS_PER_SHARD = 2


@dataclasses.dataclass(frozen=True)
class Budget:
  bulk_connections: int
  grpc_connections: int
  shards: int

  @property
  def total(self) -> int:
    return (self.bulk_connections + self.grpc_connections
            + DESCRIPTORS_PER_SHARD * self.shards + RESERVED_DESCRIPTORS)

  def __str__(self) -> str:
    return (f"{self.total} descriptors = {self.bulk_connections} bulk + "
            f"{self.grpc_connections} gRPC connections + {DESCRIPTORS_PER_SHARD} x "
            f"{self.shards} shards + {RESERVED_DESCRIPTORS} reserved")


def secure(budget: Budget) -> int:
  """Raises the soft open-files limit to `budget.total` where the hard limit
  allows; returns the soft limit now in force (warning if it is short)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = budget.total
  if soft != resource.RLIM_INFINITY and soft < want:
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
      soft = new
    except (ValueError, OSError):
      pass
  if soft != resource.RLIM_INFINITY and soft < want:
    log.warning("open-files limit %d is below this worker's budget of %s: past it new "
                "connections are refused; raise the limit (ulimit -n, the container's "
                "nofile) or lower --max-bulk-connections / --max-grpc-connections",
                soft, budget)
  return soft if soft != resource.RLIM_INFINITY else 1 << 31


def exhausted(e: OSError) -> str | None:
  """What ran out, for an error that says file descriptors did (EMFILE:
  this process's, with its limit; ENFILE: the system's); None for any other."""
  if e.errno == errno.EMFILE:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
      held = str(len(os.listdir("/proc/self/fd")) - 1)  # not the listing's own
    except OSError:  # listing needs a descriptor too
      held = "all"
    return (f"this process is out of file descriptors ({e.strerror}: {held} open, "
            f"open-files limit {soft}, hard limit {hard}); raise the limit (ulimit -n, "
            "the container's nofile) or lower --max-bulk-connections / "
            "--max-grpc-connections")
  if e.errno == errno.ENFILE:
    try:
      with open("/proc/sys/fs/file-max", encoding="ascii") as f:
        limit = f.read().strip()
    except OSError:
      limit = "?"
    return (f"the system is out of file descriptors ({e.strerror}: fs.file-max "
            f"{limit}); raise fs.file-max or find the process holding them")
  return None
