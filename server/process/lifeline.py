"""A worker's tie to its supervisor: no worker outlives it, even one starting.

Linux sends a process its parent-death signal (PR_SET_PDEATHSIG) only if the
parent dies after the process asked for it. A worker spawned just before its
supervisor was SIGKILLed would otherwise ask too late, finish starting as an
orphan and serve the shared port for good. So a worker asks first thing, then
checks that its parent is still the supervisor that spawned it: a different
parent (init, a subreaper) means the supervisor died before the signal was
set, and the worker exits at once. It checks again before it binds a port.

`start_worker` is the spawn target, so this module is the first of ours a
worker runs; it imports nothing heavy, so the tie is made before the worker
loads gRPC, its datasets and the request path (worker.run), about a second
earlier. What the spawn bootstrap loads before any target runs (the parent's
main module, the pickled arguments) can still precede it; the parent check is
what makes that harmless.

`tied` gives any other program the same tie, to the process that starts it:
run as `python -m grain_elevator.server.process.lifeline PID -- PROGRAM ...`,
this module ties itself to PID and then becomes PROGRAM (execve keeps the
parent-death signal). The launchers of `elevator serve` and of the storage
emulators (tools/launcher.py, tools/bench/storage_servers.py) start theirs
so: a test run or a bench that is killed leaves none behind. Linux signals
a child when the *thread* that forked it ends, so start one only from a
thread that lasts as long as the child must.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Sequence

_PR_SET_PDEATHSIG = 1
# Exit status of a worker that found its supervisor gone; nobody waits for it.
EXIT_ORPHANED = 3
_MODULE = "grain_elevator.server.process.lifeline"


def tie(supervisor_pid: int | None, sig: int = signal.SIGTERM) -> None:
  """Asks for `sig` when the parent dies; exits now if the parent is no
  longer `supervisor_pid` (None: no check)."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
      pass
  if orphaned(supervisor_pid):
    os._exit(EXIT_ORPHANED)  # pylint: disable=protected-access


def orphaned(supervisor_pid: int | None) -> bool:
  """True when this process's parent is no longer `supervisor_pid`."""
  return supervisor_pid is not None and os.getppid() != supervisor_pid


def start_worker(supervisor_pid: int, *args: Any, **kwargs: Any) -> None:
  """Spawn target of a worker: ties it to `supervisor_pid`, then runs
  worker.run(*args, **kwargs)."""
  tie(supervisor_pid)
  from grain_elevator.server.process import worker  # pylint: disable=g-import-not-at-top
  worker.run(*args, supervisor_pid=supervisor_pid, **kwargs)


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
