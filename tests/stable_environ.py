"""The test process's environment keeps its variable names from the start.

gRPC's threads read the environment as they connect (getenv of
GRPC_ADDRESS_HTTP_PROXY, and the resolver's LOCALDOMAIN and RES_OPTIONS),
and nothing stops them while a test sets a variable. glibc's setenv of a
*new* name reallocates the `environ` array, freeing the one a concurrent
getenv may be walking: the pytest process died of SIGSEGV in a native
thread, in the bucket tests, whose fixtures set the storage variables for
each test. Replacing the value of a name that exists is safe (the pointer
is swapped in place and glibc never frees the old string), as is removing
one.

So every name a test or an in-process `Server` sets is declared here and put
in the environment at start-up, before any thread runs, with a value that
means what its absence means. Names added later are recorded and reported at
the end of the run (`late_names`), so a new test that adds one is noticed.
Two come and go by design, one at a time, which keeps the array's size (a
realloc one pointer smaller stays in place): pytest's PYTEST_CURRENT_TEST
around each test, and the metrics folder a `Server` gives each worker it
spawns, which cannot be declared (prometheus_client takes its presence, even
empty, as multiprocess mode).
"""

from __future__ import annotations

import os
import tempfile

from grain_elevator.server.data.shards.reader import READER_ENV
from grain_elevator.server.process.supervisor import WORKER_ENV
from grain_elevator.server.serving import metrics
from grain_elevator.tools.testing import storage_servers

# Each value means what the variable's absence means to everything that
# reads it: our code reads these with `or`, CPython ignores an empty
# PYTHONPATH, ld.so an empty LD_LIBRARY_PATH (which OpenCV's import extends),
# TMPDIR is what tempfile would pick, and WORKER_ENV's values are what an
# in-process Server would give its workers.
DECLARED: dict[str, str] = {
    **{name: "" for name in storage_servers.ENV_NAMES},
    READER_ENV: "",
    "PYTHONPATH": "",
    "LD_LIBRARY_PATH": "",
    "TMPDIR": tempfile.gettempdir(),
    **WORKER_ENV,
}

ONE_AT_A_TIME = ("PYTEST_CURRENT_TEST", metrics.ENV)

_present: set[str] = set()
_late: list[str] = []


def declare() -> None:
  """Puts every declared name in the environment, then records additions."""
  for name, value in DECLARED.items():
    os.environ.setdefault(name, value)
  _present.update(os.environ)
  putenv, unsetenv = os.putenv, os.unsetenv

  def recording_putenv(name, value) -> None:
    key = os.fsdecode(name)
    if key not in _present and key not in ONE_AT_A_TIME:
      _late.append(key)
      _present.add(key)
    putenv(name, value)

  def recording_unsetenv(name) -> None:
    _present.discard(os.fsdecode(name))
    unsetenv(name)

  # os.environ calls the module's putenv/unsetenv by name, so it calls these.
  os.putenv, os.unsetenv = recording_putenv, recording_unsetenv


def late_names() -> list[str]:
  """Names added after start-up, in order, each once."""
  return list(dict.fromkeys(_late))
