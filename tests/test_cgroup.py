"""The default worker count honours the container's CPU limit, read from
cgroup files laid out as the kernel lays them out."""

from __future__ import annotations

import os
import pathlib

import pytest

from grain_elevator.server import ServerOptions, cgroup
from grain_elevator.tools import cli


def _v2(tmp_path: pathlib.Path, limits: dict[str, str]) -> tuple[str, str]:
  for rel, text in limits.items():
    folder = tmp_path / "cg" / rel
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(text)
  proc = tmp_path / "self-cgroup"
  proc.write_text("0::/kubepods/pod1/c1\n")
  return str(tmp_path / "cg"), str(proc)


def test_v2_quota_is_the_tightest_up_the_tree(tmp_path):
  root, proc = _v2(tmp_path, {"kubepods": "max 100000",
                              "kubepods/pod1": "250000 100000",
                              "kubepods/pod1/c1": "max 100000"})
  assert cgroup.cgroup_quota(root, proc) == 2.5
  assert cgroup.usable_cpus(root, proc) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_means_the_affinity(tmp_path):
  root, proc = _v2(tmp_path, {"kubepods/pod1/c1": "max 100000"})
  assert cgroup.cgroup_quota(root, proc) is None
  assert cgroup.usable_cpus(root, proc) == len(os.sched_getaffinity(0))


def test_a_fraction_of_a_cpu_is_one_worker(tmp_path):
  root, proc = _v2(tmp_path, {"kubepods/pod1/c1": "50000 100000"})
  assert cgroup.usable_cpus(root, proc) == 1


def test_v1_quota(tmp_path):
  folder = tmp_path / "cg" / "cpu" / "docker" / "abc"
  folder.mkdir(parents=True)
  (folder / "cpu.cfs_quota_us").write_text("300000\n")
  (folder / "cpu.cfs_period_us").write_text("100000\n")
  proc = tmp_path / "self-cgroup"
  proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
  assert cgroup.cgroup_quota(str(tmp_path / "cg"), str(proc)) == 3.0


def test_missing_or_garbled_files_mean_no_quota(tmp_path):
  assert cgroup.cgroup_quota(str(tmp_path), str(tmp_path / "none")) is None
  root, proc = _v2(tmp_path, {"kubepods/pod1/c1": "garbage"})
  assert cgroup.cgroup_quota(root, proc) is None


def test_serve_takes_auto_or_a_number():
  parser = cli.build_parser()
  assert parser.parse_args(["serve", "--config", "x", "--workers", "auto"]).workers is None
  assert parser.parse_args(["serve", "--config", "x", "--workers", "3"]).workers == 3
  with pytest.raises(SystemExit):
    parser.parse_args(["serve", "--config", "x", "--workers", "many"])
  assert ServerOptions().num_workers == cgroup.usable_cpus()
