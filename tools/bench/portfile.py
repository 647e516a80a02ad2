"""How a benchmark's helper server process tells its parent which port it took."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time


def write(path: str | os.PathLike[str], port: int) -> None:
  """Atomically, so the parent never reads half a number."""
  tmp = f"{os.fspath(path)}.tmp"
  with open(tmp, "w") as f:
    f.write(str(port))
  os.replace(tmp, path)


def wait(path: pathlib.Path, proc: subprocess.Popen, deadline: float) -> int | None:
  """The port once `path` appears; None if `proc` exits or `deadline`
  (time.monotonic) passes first."""
  while not path.exists():
    if proc.poll() is not None or time.monotonic() > deadline:
      return None
    time.sleep(0.05)
  return int(path.read_text())
