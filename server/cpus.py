"""How many CPUs this server may use: the default number of workers.

`os.cpu_count()` counts the node's cores, not the container's share: a pod
limited to 8 CPUs on a 96-core node would start 96 workers (~200 MB each)
and be throttled and OOM-killed. The usable count is the process's CPU
affinity, capped by the tightest CFS quota of its cgroup and the cgroup's
ancestors (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), rounded down
(at least 1): each worker is a process that keeps a core busy.
"""

from __future__ import annotations

import math
import os
import pathlib


def _v2_quota(root: pathlib.Path, path: str) -> float | None:
  """The tightest `cpu.max` from the cgroup at `path` up to the root."""
  tightest = None
  folder = root / path.lstrip("/")
  while True:
    try:
      limit, period = (folder / "cpu.max").read_text().split()[:2]
      if limit != "max":
        quota = int(limit) / int(period)
        tightest = quota if tightest is None else min(tightest, quota)
    except (OSError, ValueError):
      pass
    if folder == root or root not in folder.parents:
      return tightest
    folder = folder.parent


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


def cgroup_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                 ) -> float | None:
  """CPUs the cgroup's CFS quota allows (e.g. 2.5), or None without one."""
  try:
    lines = pathlib.Path(proc_cgroup).read_text().splitlines()
  except OSError:
    return None
  base = pathlib.Path(root)
  for line in lines:
    hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
    if hierarchy == "0" and controllers == "":
      return _v2_quota(base, path)
    if "cpu" in controllers.split(","):
      return _v1_quota(base, path)
  return None


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
