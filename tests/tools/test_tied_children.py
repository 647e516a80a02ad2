"""Children that the launchers start die with the process that started them
(server/process/lifeline.py `tied`): a test run or a bench killed with
SIGKILL leaves no `elevator serve` and no storage emulator behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from grain_elevator.server.process import lifeline

pytestmark = pytest.mark.slow  # launchers killed

_GONE_WITHIN_S = 60.0

_START = {
    "server": """
        from grain_elevator.tools.testing.launcher import LocalServer
        child = LocalServer(sys.argv[1], workers=1).proc
    """,
    "emulator": """
        from grain_elevator.tools.testing import storage_servers
        try:
          child = storage_servers.S3Server().proc
        except storage_servers.ServerUnavailable as e:
          print("unavailable", e, flush=True)
          sys.exit(0)
    """,
}


def _gone(pid: int) -> bool:
  """True once `pid` has exited (a zombie nobody reaps counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] == "Z"
  except FileNotFoundError:
    return True


def _line(stream, timeout_s: float = _GONE_WITHIN_S) -> str:
  ready, _, _ = select.select([stream], [], [], timeout_s)
  assert ready, f"no line within {timeout_s:.0f} s"
  return stream.readline().strip()


@pytest.mark.parametrize("kind", sorted(_START))
def test_a_child_dies_with_the_process_that_started_it(kind, config_path):
  script = "import sys, threading\n" + textwrap.dedent(_START[kind]) + (
      "print(child.pid, flush=True)\nthreading.Event().wait()\n")
  parent = subprocess.Popen([sys.executable, "-c", script, config_path],
                            stdout=subprocess.PIPE, text=True)
  try:
    line = _line(parent.stdout, 180).split()
    if line and line[0] == "unavailable":
      pytest.skip(" ".join(line[1:]))
    child = int(line[0])
    assert not _gone(child)
  finally:
    parent.kill()
    parent.wait(30)
  deadline = time.monotonic() + _GONE_WITHIN_S
  while not _gone(child):
    assert time.monotonic() < deadline, f"{kind} {child} outlived its parent"
    time.sleep(0.05)


def test_a_child_whose_parent_is_gone_never_starts(tmp_path):
  marker = tmp_path / "ran"
  argv = lifeline.tied(["touch", str(marker)])
  pid_at = argv.index(str(os.getpid()))
  argv[pid_at] = "1"  # not its parent: the parent it was made for has died
  done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
  assert done.returncode == lifeline.EXIT_ORPHANED
  assert not marker.exists()
  subprocess.run(lifeline.tied(["touch", str(marker)]), check=True, timeout=60)
  assert marker.exists()


def test_a_malformed_command_line_is_refused_with_its_usage():
  done = subprocess.run([sys.executable, "-m", "grain_elevator.server.process.lifeline",
                         "not-a-pid", "true"], capture_output=True, text=True, timeout=60)
  assert done.returncode != 0 and "usage:" in done.stderr


def test_sigterm_is_what_the_child_gets():
  """The launchers' children stop cleanly on SIGTERM (`elevator serve`
  stops its workers): the tie asks for it, not SIGKILL."""
  parent = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent("""
          import subprocess, sys, threading
          from grain_elevator.server.process import lifeline
          code = "import signal, sys, threading; signal.signal(signal.SIGTERM, lambda *_: (print('term', flush=True), sys.exit(0))); print('up', flush=True); threading.Event().wait()"
          child = subprocess.Popen(lifeline.tied([sys.executable, "-c", code]))
          threading.Event().wait()
      """)], stdout=subprocess.PIPE, text=True)
  try:
    assert _line(parent.stdout) == "up"
    os.kill(parent.pid, signal.SIGKILL)
    assert _line(parent.stdout) == "term"
  finally:
    parent.kill()
    parent.wait(30)
