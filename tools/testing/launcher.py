"""Start an `elevator serve` child process and learn its address.

Used by the demo, the benchmarks and the tests; a real process, so what they
exercise is exactly what an operator runs. (In-process, use
`grain_elevator.server.Server`.) The child is tied to this process
(server/process/lifeline.py `tied`): a killed test run or bench leaves no
server behind. Linux signals the child when the thread that started it
ends, so start one from a thread that outlives it (the main thread).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
from typing import Mapping, Sequence

from grain_elevator.server.process import lifeline
from grain_elevator.server.process.supervisor import parse_ready_line

ELEVATOR = (sys.executable, "-m", "grain_elevator.tools.cli")


class LocalServer:
  """`elevator serve` in a child process; a context manager that stops it."""

  def __init__(self, config: str, *, workers: int = 2, host: str = "127.0.0.1",
               port: int = 0, extra_args: Sequence[str] = (),
               prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
               start_timeout_s: float = 120.0):
    """`prefix` runs the server under another command (`ip netns exec NS`);
    `env` adds to this process's environment. A server that has not said it
    is ready after `start_timeout_s` is killed and reported, not waited on."""
    self.config = str(config)
    self.proc = subprocess.Popen(
        lifeline.tied([*prefix, *ELEVATOR, "serve", "--config", str(config), "--host", host,
                       "--port", str(port), "--workers", str(workers), *extra_args]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env} if env else None)
    self._stderr: list[str] = []
    self._drain = threading.Thread(target=self._read_stderr, daemon=True)
    self._drain.start()
    line = self._ready_line(start_timeout_s)
    ready = parse_ready_line(line) if line is not None else None
    if ready is None:
      if line is None:  # silent: stuck while starting
        self.proc.kill()
      self.proc.wait(30)
      self._drain.join(5)
      why = (f"not ready after {start_timeout_s:.0f} s, killed" if line is None
             else f"exit {self.proc.returncode}")
      raise RuntimeError(f"elevator serve did not start ({why}):\n{self.stderr()}")
    self.host, self.port, self.bulk_port, self.health_port = ready
    self.target = f"{self.host}:{self.port}"
    self.health_target = f"{self.host}:{self.health_port}"

  def _ready_line(self, timeout_s: float) -> str | None:
    """The server's first line of stdout ("" at EOF), None after `timeout_s`."""
    with selectors.DefaultSelector() as sel:
      sel.register(self.proc.stdout, selectors.EVENT_READ)
      if not sel.select(timeout_s):
        return None
    return self.proc.stdout.readline()

  def _read_stderr(self) -> None:
    for line in self.proc.stderr:
      self._stderr.append(line)

  def stderr(self) -> str:
    """What the server has logged so far."""
    return "".join(self._stderr)

  def stop(self, timeout: float = 30.0) -> int:
    """SIGTERM, wait for a clean exit (SIGKILL after `timeout`)."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      return self.proc.wait()

  def __enter__(self) -> "LocalServer":
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()
