"""Pods change behind a DNS name (a headless Service) while a trainer reads
over the bulk transport: it follows the name and reads the exact stream.
A rolling update (the pod replaced by one at a new address) with default
settings; a pod added, found by the periodic refresh.

Two test hosts (network namespaces joined by a veth pair, addresses from
the documentation range 192.0.2.0/24): the servers' with two addresses, and
the trainer's, whose /etc/hosts maps the Service's name to them.
`ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts, so
rewriting that file in place repoints the name for the running trainer, as
the cluster DNS does when a pod is replaced. Skipped where network
namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable

import pytest

from grain_elevator.tools.testing.launcher import LocalServer
from helpers import SCRIPTS

pytestmark = pytest.mark.netns
SCRIPT = SCRIPTS / "paced_stream_check.py"
OLD_IP, NEW_IP, CLIENT_IP = "192.0.2.1", "192.0.2.3", "192.0.2.2"
NAME = "elevator-svc"
# Bounds on a hang, not on speed: a run takes ~30-70 s on a loaded 2-core
# machine (servers and a trainer start, a replacement server starts mid-run).
BUDGET_S = 240.0


def _sh(*cmd: str) -> None:
  subprocess.run(cmd, check=True, capture_output=True)


def _point_name_at(hosts_file: pathlib.Path, *ips: str) -> None:
  """In place (same inode): the trainer's /etc/hosts is a bind mount of it."""
  with open(hosts_file, "r+") as f:
    f.truncate(0)
    f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {NAME}\n" for ip in ips))


@pytest.fixture
def hosts():
  """(servers' namespace, trainer's namespace, the trainer's hosts file)."""
  tag = f"gd{os.getpid() % 100000}"
  srv, cli = f"{tag}s", f"{tag}c"
  etc = pathlib.Path("/etc/netns") / cli
  try:
    _sh("ip", "netns", "add", srv)
  except (subprocess.CalledProcessError, FileNotFoundError) as e:
    pytest.skip(f"cannot create network namespaces here: {e}")
  try:
    _sh("ip", "netns", "add", cli)
    _sh("ip", "link", "add", f"{tag}a", "netns", srv, "type", "veth", "peer", "name",
        f"{tag}b", "netns", cli)
    for ns, dev, ips in ((srv, f"{tag}a", (OLD_IP, NEW_IP)), (cli, f"{tag}b", (CLIENT_IP,))):
      for ip in ips:
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
      _sh("ip", "-n", ns, "link", "set", dev, "up")
      _sh("ip", "-n", ns, "link", "set", "lo", "up")
    etc.mkdir(parents=True, exist_ok=True)
    hosts_file = etc / "hosts"
    hosts_file.touch()
    _point_name_at(hosts_file, OLD_IP)
    yield srv, cli, hosts_file
  finally:
    for ns in (srv, cli):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if etc.exists():
      (etc / "hosts").unlink(missing_ok=True)
      etc.rmdir()
    try:
      etc.parent.rmdir()  # only if no other test's namespace uses it
    except OSError:
      pass


def _train_through(cli: str, config_path: str, port: int,
                   change: Callable[[Callable[[], None]], None], *extra: str,
                   meanwhile: Callable[[], None] = lambda: None) -> tuple[str, str]:
  """Runs the trainer against dns:///NAME:port, calls `meanwhile()` while it
  starts (a pod the name does not point at yet starts beside it, not after
  it) and, at step 60 (the trainer waits there), `change(go)`; `go()` lets
  the trainer go on. Returns its stdout and stderr once it has read the
  whole stream, within BUDGET_S."""
  started = time.monotonic()
  log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill and block it
  trainer = subprocess.Popen(
      ["ip", "netns", "exec", cli, sys.executable, str(SCRIPT),
       "--target", f"dns:///{NAME}:{port}", "--config", config_path,
       "--dataset", "aug2", "-G", "8", "--hold-at", "60", "--step-s", "0.02", *extra],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

  def go() -> None:
    trainer.stdin.write("go\n")
    trainer.stdin.flush()

  def err() -> str:
    log.seek(0)
    return log.read()

  with log:
    try:
      meanwhile()
      line = trainer.stdout.readline()
      if line.strip() != "AT 60":
        trainer.wait(30)
        pytest.fail(f"trainer stopped before step 60: {line}\n{err()}")
      change(go)
      left = max(5.0, BUDGET_S - (time.monotonic() - started))
      try:
        out, _ = trainer.communicate(timeout=left)
      except subprocess.TimeoutExpired:
        trainer.kill()
        out, _ = trainer.communicate()
        pytest.fail(f"trainer still running after {BUDGET_S:.0f}s:\n{out}\n{err()}")
    finally:
      if trainer.poll() is None:
        trainer.kill()
        trainer.wait()
    logged = err()
  assert trainer.returncode == 0, out + logged
  assert "OK 250" in out.splitlines(), out + logged
  return out, logged


def _served(out: str) -> dict[str, int]:
  """The trainer's SERVED line: steps received per address."""
  (line,) = [l for l in out.splitlines() if l.startswith("SERVED")]
  return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


@pytest.mark.timeout(BUDGET_S + 150)
def test_bulk_trainer_follows_the_name_when_its_pod_is_replaced(hosts, config_path):
  srv, cli, hosts_file = hosts
  in_srv = ("ip", "netns", "exec", srv)
  replacement: list[LocalServer] = []
  with LocalServer(config_path, workers=1, host=OLD_IP, prefix=in_srv) as old:

    def new_pod() -> None:
      """Same config, same ports, a new address, which the name does not
      point at until the update."""
      replacement.append(LocalServer(config_path, workers=1, host=NEW_IP, port=old.port,
                                     prefix=in_srv,
                                     extra_args=("--bulk-port", str(old.bulk_port))))

    def rolling_update(go: Callable[[], None]) -> None:
      assert replacement, "the new pod did not start"
      _point_name_at(hosts_file, NEW_IP)
      go()
      time.sleep(0.1)  # the trainer is streaming again when the old pod goes
      old.stop()

    try:
      out, err = _train_through(cli, config_path, old.port, rolling_update, meanwhile=new_pod)
    finally:
      for server in replacement:
        server.stop()
  assert f"now resolves to {NEW_IP}" in err, err  # it moved mid-stream
  assert set(_served(out)) == {NEW_IP}, out  # the old pod's connections were retired


@pytest.mark.timeout(BUDGET_S + 150)
def test_a_pod_added_behind_the_name_gets_connections(hosts, config_path):
  """No failure prompts a reconnect here: the periodic refresh finds it."""
  srv, cli, hosts_file = hosts
  in_srv = ("ip", "netns", "exec", srv)
  added: list[LocalServer] = []
  with LocalServer(config_path, workers=1, host=OLD_IP, prefix=in_srv) as first:

    def second_pod() -> None:
      """Same ports, another address, which the name does not hold yet."""
      added.append(LocalServer(config_path, workers=1, host=NEW_IP, port=first.port,
                               prefix=in_srv, extra_args=("--bulk-port", str(first.bulk_port))))

    def scale_out(go: Callable[[], None]) -> None:
      assert added, "the second pod did not start"
      _point_name_at(hosts_file, OLD_IP, NEW_IP)
      go()

    try:
      out, _ = _train_through(cli, config_path, first.port, scale_out, "--dns-refresh-s", "0.5",
                              meanwhile=second_pod)
    finally:
      for server in added:
        server.stop()
  served = _served(out)
  assert served.get(NEW_IP, 0) > 0 and served.get(OLD_IP, 0) > 0, out
