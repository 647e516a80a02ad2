"""A worker's tie to its supervisor: no worker outlives it, even one starting.

Workers are forked by multiprocessing's fork server (supervisor.py), so a
worker's parent is that server, not the supervisor. What tells a worker
that its supervisor died is the pipe its start-up came through, whose other
end the supervisor holds until it dies (`multiprocessing.parent_process()`):
first thing, a worker checks it, and a thread then waits on it and sends
the worker SIGTERM when it ends. The end of a pipe stays, so a worker
started just before its supervisor was SIGKILLed exits at once instead of
finishing its start as an orphan and serving the shared port for good. It
checks again before it binds a port. A worker also asks for SIGTERM on its
parent's death (PR_SET_PDEATHSIG), should the fork server die first.

`start_worker` is the process target, so this module is the first of ours a
worker runs; it also gives the worker the environment its supervisor meant
for it (a forked worker has its fork server's), and a name in `ps` and
`top` (`elevator-w3`).

`tied` ties any other program to the process that starts it, by the
parent-death signal and a check that its parent is that process: run as `python -m grain_elevator.server.process.lifeline PID -- PROGRAM ...`,
this module ties itself to PID and then becomes PROGRAM (execve keeps the
parent-death signal). The launchers of `elevator serve` and of the storage
emulators (tools/testing/launcher.py, tools/testing/storage_servers.py) start theirs
so: a test run or a bench that is killed leaves none behind. Linux signals
a child when the *thread* that forked it ends, so start one only from a
thread that lasts as long as the child must.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, Mapping, Sequence

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Exit status of a worker that found its supervisor gone; nobody waits for it.
EXIT_ORPHANED = 3
_MODULE = "grain_elevator.server.process.lifeline"


def tie(supervisor_pid: int | None, sig: int = signal.SIGTERM) -> None:
  """Asks for `sig` when the parent dies; exits now if `supervisor_pid` is
  gone (`orphaned`; None: no check)."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
      pass
  if orphaned(supervisor_pid):
    os._exit(EXIT_ORPHANED)  # pylint: disable=protected-access


def orphaned(supervisor_pid: int | None) -> bool:
  """True when `supervisor_pid` (None: no check) is gone: for a process
  multiprocessing started from it, its start-up pipe says so; for any other,
  its parent is no longer that process."""
  if supervisor_pid is None:
    return False
  parent = multiprocessing.parent_process()
  if parent is not None and parent.pid == supervisor_pid:
    return not parent.is_alive()
  return os.getppid() != supervisor_pid


def start_worker(supervisor_pid: int, *args: Any, env: Mapping[str, str] | None = None,
                 title: str | None = None, **kwargs: Any) -> None:
  """Process target of a worker: ties it to `supervisor_pid`, takes `env` as
  its environment and `title` as its name, then runs worker.run(*args,
  **kwargs)."""
  signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it
  tie(supervisor_pid)
  _watch_supervisor(supervisor_pid)
  if env is not None:
    _adopt(env)
  if title is not None:
    _set_name(title)
  from grain_elevator.server.process import worker  # pylint: disable=g-import-not-at-top
  worker.run(*args, supervisor_pid=supervisor_pid, **kwargs)


def _watch_supervisor(supervisor_pid: int) -> None:
  """SIGTERM to this process when the supervisor dies: when its start-up
  pipe ends, or its pidfd says so (a child the supervisor forked, holding
  the pipe's end, would keep the pipe open). The parent-death signal comes
  from the fork server, which outlives the supervisor while any worker holds
  the descriptor that keeps it up."""
  from multiprocessing import connection  # pylint: disable=g-import-not-at-top
  parent = multiprocessing.parent_process()
  if parent is None:
    return
  handles: list[Any] = [parent.sentinel]
  try:
    handles.append(os.pidfd_open(supervisor_pid))
  except (AttributeError, OSError):  # no pidfd (Linux < 5.3), or already gone
    pass
  if orphaned(supervisor_pid):  # gone before its pidfd was opened
    os._exit(EXIT_ORPHANED)  # pylint: disable=protected-access

  def watch() -> None:
    connection.wait(handles)
    os.kill(os.getpid(), signal.SIGTERM)
  threading.Thread(target=watch, name="elevator-lifeline", daemon=True).start()


def _adopt(env: Mapping[str, str]) -> None:
  """`env` as this process's environment, with what in it is read only once
  per process applied too: glibc's allocator settings (read at exec) and
  numpy's huge-page advice (at import), which the fork server read before."""
  for name in [n for n in os.environ if n not in env]:
    del os.environ[name]
  for name, value in env.items():
    if os.environ.get(name) != value:
      os.environ[name] = value
  from grain_elevator.proto import malloc  # pylint: disable=g-import-not-at-top
  if all(name in env for name in malloc.ENV):
    try:
      malloc.tune_malloc(int(env["MALLOC_MMAP_THRESHOLD_"]), int(env["MALLOC_TRIM_THRESHOLD_"]))
    except ValueError:
      pass  # not numbers: glibc ignores them too
  if "NUMPY_MADVISE_HUGEPAGE" in env and "numpy" in sys.modules:  # read at numpy's import
    multiarray = getattr(getattr(sys.modules["numpy"], "_core", None), "multiarray", None)
    advise = getattr(multiarray, "_set_madvise_hugepage", None)
    if advise is not None:
      advise(env["NUMPY_MADVISE_HUGEPAGE"] != "0")


def _set_name(title: str) -> None:
  """This process's name (at most 15 bytes) as `ps`, `top` and psutil show it."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, title.encode()[:15])
    except (OSError, AttributeError):
      pass


def tied(argv: Sequence[str]) -> list[str]:
  """`argv` as a command line that runs it tied to this process: it gets
  SIGTERM when this process dies, and never starts if it has died already."""
  return [sys.executable, "-m", _MODULE, str(os.getpid()), "--", *argv]


def _exec_tied(args: Sequence[str]) -> None:
  """`PID -- PROGRAM ARGS...`: tie to PID, then become PROGRAM."""
  if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
    sys.exit(f"usage: python -m {_MODULE} PID -- PROGRAM [ARGS...]")
  tie(int(args[0]))
  os.execvp(args[2], list(args[2:]))


if __name__ == "__main__":
  _exec_tied(sys.argv[1:])
