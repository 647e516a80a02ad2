"""The default worker count honours the container's CPU limit, read from
cgroup files laid out as the kernel lays them out."""

from __future__ import annotations

import os
import pathlib

import pytest

from grain_elevator.server import ConfigError, ServerOptions

from grain_elevator.server.serving import cgroup
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


def test_memory_limit_is_the_tightest_up_the_tree_else_the_ram(tmp_path):
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for rel, text in {"kubepods": "max\n", "kubepods/pod1": f"{6 << 30}\n",
                    "kubepods/pod1/c1": "max\n"}.items():
    (tmp_path / "cg" / rel).mkdir(parents=True, exist_ok=True)
    (tmp_path / "cg" / rel / "memory.max").write_text(text)
  proc = tmp_path / "self-cgroup"
  proc.write_text("0::/kubepods/pod1/c1\n")
  assert cgroup.memory_bytes(str(tmp_path / "cg"), str(proc)) == min(6 << 30, ram)
  (tmp_path / "cg" / "kubepods/pod1" / "memory.max").write_text("max\n")
  assert cgroup.memory_bytes(str(tmp_path / "cg"), str(proc)) == ram


def test_v1_memory_limit_and_its_no_limit_value(tmp_path):
  folder = tmp_path / "cg" / "memory" / "docker" / "abc"
  folder.mkdir(parents=True)
  proc = tmp_path / "self-cgroup"
  proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
  (folder / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
  assert cgroup.memory_bytes(str(tmp_path / "cg"), str(proc)) == 1 << 30
  (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert cgroup.memory_bytes(str(tmp_path / "cg"), str(proc)) == ram


def test_the_default_batch_cache_is_a_sixteenth_of_memory_at_most_512_mib():
  assert ServerOptions(batch_cache_mb=0).batch_cache_bytes == 0
  assert ServerOptions(batch_cache_mb=100).batch_cache_bytes == 100 << 20
  assert ServerOptions().batch_cache_bytes == min(512 << 20, cgroup.memory_bytes() // 16)
  with pytest.raises(ConfigError, match="batch_cache_mb"):
    ServerOptions(batch_cache_mb=-1)
