"""What the container may use of its node: CPUs (the default number of
workers) and memory (the default batch cache).

`os.cpu_count()` counts the node's cores, not the container's share: a pod
limited to 8 CPUs on a 96-core node would start 96 workers (~200 MB each)
and be throttled and OOM-killed. The usable count is the process's CPU
affinity, capped by the tightest CFS quota of its cgroup and the cgroup's
ancestors (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), rounded down
(at least 1): each worker is a process that keeps a core busy. Memory
likewise: the tightest `memory.max` (v2) or `memory.limit_in_bytes` (v1),
else the machine's RAM.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Callable


def _tightest_up(root: pathlib.Path, path: str, name: str,
                 parse: Callable[[str], float | None]) -> float | None:
  """The smallest `parse(file)` of the `name` files from the cgroup at
  `path` up to the root (limits nest: the tightest one binds)."""
  tightest = None
  folder = root / path.lstrip("/")
  while True:
    try:
      value = parse((folder / name).read_text())
    except (OSError, ValueError):
      value = None
    if value is not None:
      tightest = value if tightest is None else min(tightest, value)
    if folder == root or root not in folder.parents:
      return tightest
    folder = folder.parent


def _cpu_max(text: str) -> float | None:
  limit, period = text.split()[:2]
  return None if limit == "max" else int(limit) / int(period)


def _memory_max(text: str) -> int | None:
  text = text.strip()
  return None if text == "max" else int(text)


def _v2_quota(root: pathlib.Path, path: str) -> float | None:
  return _tightest_up(root, path, "cpu.max", _cpu_max)


def _v1_quota(root: pathlib.Path, path: str) -> float | None:
  folder = root / "cpu" / path.lstrip("/")
  for candidate in (folder, root / "cpu"):
    try:
      quota = int((candidate / "cpu.cfs_quota_us").read_text())
      period = int((candidate / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
      continue
    if quota > 0 and period > 0:
      return quota / period
  return None


def _own_cgroup(controller: str, proc_cgroup: str) -> tuple[int, str] | None:
  """(cgroup version, path) of this process for `controller`, from /proc."""
  try:
    lines = pathlib.Path(proc_cgroup).read_text().splitlines()
  except OSError:
    return None
  for line in lines:
    hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
    if hierarchy == "0" and controllers == "":
      return 2, path
    if controller in controllers.split(","):
      return 1, path
  return None


def cgroup_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                 ) -> float | None:
  """CPUs the cgroup's CFS quota allows (e.g. 2.5), or None without one."""
  found = _own_cgroup("cpu", proc_cgroup)
  if found is None:
    return None
  version, path = found
  base = pathlib.Path(root)
  return _v2_quota(base, path) if version == 2 else _v1_quota(base, path)


def _v2_memory(root: pathlib.Path, path: str) -> int | None:
  limit = _tightest_up(root, path, "memory.max", _memory_max)
  return None if limit is None else int(limit)


def _v1_memory(root: pathlib.Path, path: str) -> int | None:
  for candidate in (root / "memory" / path.lstrip("/"), root / "memory"):
    try:
      limit = int((candidate / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
      continue
    if 0 < limit < 1 << 60:  # "no limit" reads as a page-rounded 2^63
      return limit
  return None


def memory_bytes(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
  """The cgroup's memory limit, else the machine's RAM."""
  limit = None
  found = _own_cgroup("memory", proc_cgroup)
  if found is not None:
    version, path = found
    base = pathlib.Path(root)
    limit = _v2_memory(base, path) if version == 2 else _v1_memory(base, path)
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return min(limit, ram) if limit else ram


def usable_cpus(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
  """The affinity's CPU count, capped by the cgroup quota, at least 1."""
  try:
    count = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    count = os.cpu_count() or 1
  quota = cgroup_quota(root, proc_cgroup)
  if quota is not None:
    count = min(count, max(1, math.floor(quota)))
  return max(1, count)
