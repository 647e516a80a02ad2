"""Server and client on two test hosts (network namespaces joined by a veth
pair, addresses from the documentation range 192.0.2.0/24), with a rate-limited
link and 1% random packet loss; the stream is still exact.

tc netem is not in this kernel, so delay comes from a tbf queue (50 ms of
latency budget at 200 Mbit/s) and loss from iptables' statistic match.
Skipped where network namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from grain_elevator.tools.testing.launcher import LocalServer
from helpers import SCRIPTS

pytestmark = pytest.mark.netns
SCRIPT = SCRIPTS / "stream_check.py"
SERVER_IP, CLIENT_IP = "192.0.2.1", "192.0.2.2"


def _sh(*cmd: str) -> None:
  subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def hosts():
  if shutil.which("iptables") is None:
    pytest.skip("iptables is not installed (`make test` installs it with apt as root)")
  tag = f"ge{os.getpid() % 100000}"
  srv, cli = f"{tag}s", f"{tag}c"
  try:
    _sh("ip", "netns", "add", srv)
  except (subprocess.CalledProcessError, FileNotFoundError) as e:
    pytest.skip(f"cannot create network namespaces here: {e}")
  try:
    _sh("ip", "netns", "add", cli)
    _sh("ip", "link", "add", f"{tag}a", "netns", srv, "type", "veth", "peer", "name",
        f"{tag}b", "netns", cli)
    for ns, dev, ip in ((srv, f"{tag}a", SERVER_IP), (cli, f"{tag}b", CLIENT_IP)):
      _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
      _sh("ip", "-n", ns, "link", "set", dev, "up")
      _sh("ip", "-n", ns, "link", "set", "lo", "up")
      _sh("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", dev, "-m",
          "statistic", "--mode", "random", "--probability", "0.01", "-j", "DROP")
    _sh("ip", "netns", "exec", srv, "tc", "qdisc", "add", "dev", f"{tag}a", "root", "tbf",
        "rate", "200mbit", "burst", "256kb", "latency", "50ms")
    yield srv, cli
  finally:
    for ns in (srv, cli):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_exact_stream_across_a_lossy_rate_limited_link(hosts, config_path):
  srv, cli = hosts
  with LocalServer(config_path, workers=2, host=SERVER_IP,
                   prefix=("ip", "netns", "exec", srv)) as server:
    result = subprocess.run(
        ["ip", "netns", "exec", cli, sys.executable, str(SCRIPT), "--target", server.target,
         "--config", config_path, "--dataset", "aug2", "-G", "8"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "OK 250"
