"""A server: N worker processes on one port, kept alive; `elevator serve`.

`Server` is the Python API (a context manager: tests and programs start a
real server without a shell); `serve` is the CLI's blocking form, stopped by
SIGINT/SIGTERM. Either validates the config and options first, starts the
workers, restarts any that die (logging why) and stops them all on exit.

Restarts back off per worker slot (restarts.py): the first after
RESTART_DELAY_MIN_S, doubling to at most RESTART_DELAY_MAX_S, back to the
minimum once a worker has stayed up RESTART_STABLE_AFTER_S. One thread does all of it and never blocks on one worker, so a slot
waiting out its delay holds up neither the others nor `stop`.

A slot whose worker died more than CRASH_LOOP_RESTARTS times in a row, each
within RESTART_STABLE_AFTER_S of its start, is crash-looping until a worker
of it stays up that long. Each of its deaths is logged at ERROR (worker, deaths in a row, exit
code or signal, next delay), and health says NOT_SERVING, for "" and the
Elevator service alike: on the health port, which this process serves
(server/serving/health_port.py, from health_board.py), and on every worker's
gRPC port, since the supervisor counts the looping slots in a shared
integer (restarts.CrashLoopFlag) that each worker polls. The whole server goes out of a load balancer's or readiness probe's
rotation rather than one worker of it, since a probe cannot pick the worker
its connection reaches (SO_REUSEPORT), and a server that keeps losing a
worker resets some clients' connections whichever one answered. Requests
are still served; only health reports the loop.

Workers are forked by multiprocessing's fork server, which imported the
worker's modules once (_PRELOAD): a worker is up in a fraction of a second,
not after the ~2.5 CPU-seconds of imports a fresh interpreter pays (Grain
imports JAX), at start-up and at every restart. As with "spawn", a worker
imports the main module first, so a program that starts a Server at import
time must guard it with `if __name__ == "__main__":`. The target is
lifeline.start_worker, which ties each worker to this process (SIGTERM when
it dies, an exit if it died already) and gives it the environment this
process has when it starts the worker (`_worker_env`) before the worker runs
anything else. The fork server ignores SIGTERM (fork_server.py) and holds
the workers' exit statuses: a worker whose fork server died is killed and
started again through a new one. Where the fork server cannot start (a
TMPDIR too long for its socket), workers are spawned, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import errno
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any, NamedTuple

from grain_elevator.proto import malloc
from grain_elevator.proto.errors import ElevatorError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.process import descriptors
from grain_elevator.server.process import head_sockets
from grain_elevator.server.data.shards import identity as shard_identity
from grain_elevator.server.process import lifeline
from grain_elevator.server.process import restarts
from grain_elevator.server.process import step_board
from grain_elevator.server.serving import sockets
from grain_elevator.server.process.health_board import HealthBoard
from grain_elevator.server.process.step_board import StepBoard
from grain_elevator.server.serving.options import ServerOptions
from grain_elevator.server.serving import auth
from grain_elevator.server.serving import health as health_lib
from grain_elevator.server.serving import metrics as metrics_lib
from grain_elevator.server.serving.grpc_service import SERVICE_NAME
from grain_elevator.server.serving.health_port import HealthPort

log = logging.getLogger("grain_elevator.server")

_START_TIMEOUT_S = 120.0
# The longest the supervise thread sleeps: how soon it sees `stop`, a
# restarted worker's start-up error and a slot that has become stable.
_POLL_S = 0.2
# How often a stop sends SIGTERM again to a worker that has not exited.
_RESEND_S = 1.0

# Environment of every worker, unless the operator set a variable already:
# glibc's allocator settings (proto/malloc.py), and numpy's huge-page advice
# off: numpy madvises arrays of 4 MiB and up as transparent huge pages, and
# each new multi-megabyte batch then faults in and zeroes fresh 2 MiB pages,
# ~20% of a worker's CPU samples on the large bench workload (perf), ~2%
# without.
WORKER_ENV = {**malloc.ENV, "NUMPY_MADVISE_HUGEPAGE": "0"}
# What the fork server imports once, for every worker it forks.
_PRELOAD = ["grain_elevator.server.process.fork_server",
            "grain_elevator.server.process.worker"]
# Why the fork server last failed to start a worker ("" while it works): said
# once per cause, and again once it works.
_fork_server_failure = ""
# The exit code multiprocessing reports for a worker whose fork server died.
_LOST_STATUS = 255
# How long the fork server may leave a worker's death unreported (the worker
# gone, its status not sent) or stay stopped (SIGSTOP) before the supervisor
# kills it and starts workers through a new one: it answers in milliseconds
# when it runs at all.
FORK_SERVER_TIMEOUT_S = 3.0
# The longest `stop` waits for the supervise thread, which never blocks for
# longer than a fork server request (bounded by FORK_SERVER_TIMEOUT_S) and
# _POLL_S; past it `stop` logs and goes on.
SUPERVISOR_JOIN_TIMEOUT_S = 10.0
# Signals a process gets from its own code going wrong (faulthandler writes
# the crashing thread's stack for these): a death by one of them while
# making one step is that step's doing (step_board.py).
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                            signal.SIGABRT})
# The most of a dead worker's fault report read (faulthandler's stacks).
_CRASH_REPORT_BYTES = 64 << 10


class StartError(ElevatorError):
  """The workers could not start (bad dataset, port in use)."""


def _running(pid: int | None) -> bool:
  """True while `pid` runs (not a zombie)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
  except (OSError, IndexError):
    return False


def _worker_env(forced: dict[str, str]) -> dict[str, str]:
  """A worker's environment: this process's, WORKER_ENV's defaults where it
  has none, and `forced` (the metrics folder)."""
  return {**WORKER_ENV, **os.environ, **forced}


def _fork_server_running() -> None:
  """Starts multiprocessing's fork server unless it runs. Raises OSError
  where it cannot: its socket's path under a TMPDIR too long for AF_UNIX (a
  CI runner's, a pod's)."""
  from multiprocessing import forkserver  # pylint: disable=g-import-not-at-top
  forkserver.ensure_running()


def _fork_server_failed(e: OSError) -> None:
  """Says once per cause why the fork server cannot start workers (which are
  spawned meanwhile)."""
  global _fork_server_failure
  if str(e) != _fork_server_failure:
    _fork_server_failure = str(e)
    hint = (" (a shorter TMPDIR fixes it: the fork server's socket path is too long)"
            if "too long" in str(e) or e.errno == errno.ENAMETOOLONG else "")
    log.warning("multiprocessing's fork server cannot start workers (%s); each is "
                "spawned and imports its modules itself, a few seconds more per "
                "start%s", e, hint)


def _fork_server_works() -> None:
  global _fork_server_failure
  if _fork_server_failure:
    _fork_server_failure = ""
    log.info("multiprocessing's fork server starts workers again")


def _fork_server_pid() -> int | None:
  from multiprocessing import forkserver  # pylint: disable=g-import-not-at-top
  return getattr(forkserver._forkserver, "_forkserver_pid", None)  # pylint: disable=protected-access


def _stopped(pid: int | None) -> bool:
  """True while `pid` is stopped (SIGSTOP, a debugger)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
  except (OSError, IndexError):
    return False


def _kill_fork_server(why: str) -> None:
  """SIGKILLs the fork server: every worker it started is then reported
  lost, killed and started again through a new one (`_note_death`)."""
  pid = _fork_server_pid()
  if pid is None or not _running(pid):
    return
  log.error("multiprocessing's fork server (pid %d) %s: killing it; its workers are "
            "started again through a new one", pid, why)
  try:
    os.kill(pid, signal.SIGKILL)
  except OSError:
    pass


class Server:
  """`elevator serve` in this process: worker processes sharing one port.

  Example:
    with Server("elevator.toml", ServerOptions(port=0, workers=2)) as server:
      ds = RemoteDataset(server.target, "train", global_batch_size=256)

  `start` (and entering the context) raises ConfigError for a bad config
  file or options, StartError when a worker cannot start and BindError for a
  port in use.
  """

  def __init__(self, config: str | os.PathLike[str],
               options: ServerOptions = ServerOptions()):
    self.config_path = str(config)
    self.options = options
    self.config: config_lib.ServerConfig | None = None
    self._ctx = mp.get_context("forkserver")
    self._ctx.set_forkserver_preload(_PRELOAD)
    # Each worker reports its start on a pipe of its own (index -> the read
    # end): a queue shared by every worker sends under one lock across
    # processes, which a worker SIGKILLed while sending keeps forever; every
    # later worker's report then never arrives, and it hangs at exit joining
    # the thread that waits for the lock.
    self._ready: dict[int, mp.connection.Connection] = {}
    self._procs: dict[int, mp.process.BaseProcess] = {}
    self._history: collections.defaultdict[int, restarts.SlotHistory] = (
        collections.defaultdict(restarts.SlotHistory))
    self._crash_loop = restarts.CrashLoopFlag(self._ctx)
    # The steps each worker is making, and those that killed one (step_board.py):
    # made by `start`. Deaths per step key, for those not blamed at once.
    self._steps: StepBoard | None = None
    self._strikes: dict[int, int] = {}
    # Where each worker's faulthandler writes the stacks of a fatal signal
    # (None: no folder could be made, and deaths are blamed without them).
    self._crash_dir: str | None = None
    # Dead slot -> when its death was first seen without its status (the
    # fork server not reporting it: FORK_SERVER_TIMEOUT_S).
    self._unreported: dict[int, float] = {}
    self._identities: shard_identity.Recorded | None = None
    self._stop = threading.Event()
    self._supervisor: threading.Thread | None = None
    self._metrics: metrics_lib.Exporter | None = None
    self._head_peers: head_sockets.HeadPeers | None = None
    # The health port (server/serving/health_port.py), answering from the
    # board that the workers and this supervisor write (health_board.py).
    self._health_board: HealthBoard | None = None
    self._health_port: HealthPort | None = None
    # A shared double per worker slot (made by `start`), set by its worker:
    # inf while a request is in flight, else time.monotonic() when its last
    # request ended (CLOCK_MONOTONIC is one clock for every process of the
    # machine). One per slot: one worker's end must not hide another's stream.
    self._activity: list[Any] = []

  # -- what it serves --------------------------------------------------------

  @property
  def host(self) -> str:
    return self.options.host

  @property
  def port(self) -> int:
    return self.options.port

  @property
  def bulk_port(self) -> int | None:
    return self.options.bulk_port if self.options.serves_bulk else None

  @property
  def health_port(self) -> int:
    return self.options.health_port

  @property
  def target(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"{host}:{self.port}"

  @property
  def num_workers(self) -> int:
    return self.options.num_workers

  @property
  def metrics_port(self) -> int | None:
    """Where /metrics is served, once started (None: no metrics)."""
    return self._metrics.port if self._metrics else None

  def idle_s(self) -> float:
    """Seconds since the last request ended (or since start); 0 while any
    request is in flight, however long it streams."""
    last = max([v.value for v in self._activity], default=time.monotonic())
    return 0.0 if math.isinf(last) else max(0.0, time.monotonic() - last)

  def worker_pids(self) -> list[int]:
    return [p.pid for p in self._procs.values() if p.is_alive() and p.pid]

  # -- lifecycle -------------------------------------------------------------

  def start(self) -> "Server":
    """Checks config and options, starts every worker, and supervises them
    from a background thread; returns once all serve."""
    self.config = config_lib.load_config(self.config_path)  # fail fast on a bad file
    # The shards and option files as they are now, recorded once: every worker,
    # a restarted one too, uses them only while they still match, and
    # fingerprints with them.
    self._identities = shard_identity.record_identities(self.config)
    opts = self.options
    if opts.tls:
      auth.server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)  # readable?
    if opts.auth_token_file:
      auth.read_token(opts.auth_token_file)
    if opts.metrics_port is not None:
      self._metrics = metrics_lib.Exporter(self.worker_pids, self.num_workers)
      try:
        self._metrics.start(opts.host, opts.metrics_port)
      except OSError as e:
        self._metrics.stop()
        raise sockets.BindError(
            f"cannot serve metrics on {opts.host}:{opts.metrics_port}: {e}") from e
    self._activity = [self._ctx.RawValue("d", time.monotonic())
                      for _ in range(self.num_workers)]
    self._steps = StepBoard(self._ctx, self.num_workers)
    try:
      self._crash_dir = tempfile.mkdtemp(prefix="elevator-crashes-")
    except OSError as e:
      log.warning("no folder for the workers' crash reports (%s): a step that kills a "
                  "worker is found only when it was the only one in flight", e)
    self._start_health_port()
    # Stream datasets' heads are computed by every worker
    # (server/data/streams/parallel_head.py).
    self._head_peers = (head_sockets.HeadPeers(self.num_workers)
                        if self.num_workers > 1 else None)
    self._start_workers()
    self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                        name="elevator-supervisor")
    self._supervisor.start()
    return self

  def _start_health_port(self) -> None:
    """Serves the health port, NOT_SERVING until every worker is ready."""
    board = self._health_board = HealthBoard(self._ctx, self.num_workers)
    board.set_reason("starting", True)
    port = self._health_port = HealthPort(
        lambda: health_lib.NOT_SERVING if board.reasons() else health_lib.SERVING,
        ("", SERVICE_NAME), watch_s=self.options.idle_timeout_s)
    try:
      resolved = port.start(self.options.host, self.options.health_port)
    except OSError as e:
      if self._metrics:
        self._metrics.stop()
      raise sockets.BindError(f"cannot serve health on {self.options.host}:"
                              f"{self.options.health_port}: {e.strerror}") from e
    self.options = dataclasses.replace(self.options, health_port=resolved)

  def _start_workers(self) -> None:
    reservations = [sockets.bind_shared(self.options.host, self.options.port)]
    try:
      resolved = {"port": reservations[0].getsockname()[1]}
      if self.options.serves_bulk:
        reservations.append(sockets.bind_shared(self.options.host, self.options.bulk_port))
        resolved["bulk_port"] = reservations[1].getsockname()[1]
      self.options = dataclasses.replace(self.options, **resolved)
      for i in range(self.num_workers):
        self._spawn(i)
      self._await_ready(set(range(self.num_workers)))
      self._health_board.set_reason("starting", False)
    except BaseException:
      self.stop()
      raise
    finally:
      for sock in reservations:
        sock.close()

  def _spawn(self, index: int) -> None:
    """Starts worker `index`; call only from a thread that lasts as long as
    the server (module docstring)."""
    reader, writer = self._ctx.Pipe(duplex=False)

    def process(ctx: Any) -> mp.process.BaseProcess:
      return ctx.Process(
          target=lifeline.start_worker,
          args=(os.getpid(), self.config_path, self.options, index, self.num_workers,
                writer, self._identities),
          kwargs={"crash_loop": self._crash_loop, "last_request": self._activity[index],
                  "head_peers": self._head_peers,
                  "health_slot": self._health_board.slot(index),
                  "step_slot": self._steps.slot(index),
                  "crash_file": self._crash_file(index),
                  "env": _worker_env(self._metrics.worker_env() if self._metrics else {}),
                  "title": f"elevator-w{index}"},
          name=f"elevator-worker-{index}", daemon=True)
    self._health_board.reset(index)
    self._steps.clear(index)
    try:
      try:
        if _stopped(_fork_server_pid()):  # it would never answer
          _kill_fork_server("is stopped")
        _fork_server_running()
        p = process(self._ctx)
        p.start()
        _fork_server_works()
      except OSError as e:  # a fork server that cannot start, or died starting
        if descriptors.exhausted(e) is not None:
          raise  # spawning needs descriptors too: _supervise tries again later
        _fork_server_failed(e)
        p = process(mp.get_context("spawn"))
        p.start()
    except BaseException:
      reader.close()
      raise
    finally:
      writer.close()  # the worker's now: its death ends the pipe
    old = self._ready.pop(index, None)
    if old is not None:
      old.close()
    self._ready[index] = reader
    self._procs[index] = p
    self._history[index].started(time.monotonic())

  def _await_ready(self, indices: set[int]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    pending = set(indices)
    while pending:
      mp.connection.wait([r for i in pending if (r := self._ready.get(i)) is not None]
                         + [self._procs[i].sentinel for i in pending], timeout=0.2)
      for i in sorted(pending):
        report = self._report(i)
        if report is None:
          if not self._procs[i].is_alive():
            raise StartError(
                f"worker {i} exited with code {self._procs[i].exitcode} while starting")
          continue
        if report[1] is not None:
          raise StartError(report[1])
        pending.discard(i)
      if pending and time.monotonic() > deadline:
        raise StartError(f"workers {sorted(pending)} did not start within "
                         f"{_START_TIMEOUT_S:.0f}s")

  def _report(self, index: int) -> tuple[int, str | None] | None:
    """What worker `index` reported of its start, once it has: (index,
    None) serving, (index, error) failed; None before, or if it died
    without a word. A start is reported once: its pipe is closed after."""
    reader = self._ready.get(index)
    if reader is None:
      return None
    try:
      if not reader.poll():
        return None
      report = reader.recv()
    except (EOFError, OSError):  # it died before reporting
      report = None
    self._ready.pop(index).close()
    return report

  def _supervise(self) -> None:
    """Restarts each dead worker once its slot's backoff has passed, until
    `stop`; sleeps at most _POLL_S at a time, so `stop` is never kept
    waiting by a backoff."""
    due: dict[int, float] = {}  # dead slot -> when to restart it
    while not self._stop.is_set():
      now = time.monotonic()
      for i in [i for i, at in due.items() if at <= now]:
        try:
          self._spawn(i)
          del due[i]
        except OSError as e:  # fork refused (EAGAIN, ENOMEM, EMFILE): try again later
          due[i] = now + self._history[i].died(now)
          log.error("worker %d could not be restarted: %s; trying again in %.1fs",
                    i, descriptors.exhausted(e) or e, due[i] - now)
          self._publish_crash_loops()
      for i, history in self._history.items():
        if history.stable(now):
          log.info("worker %d has stayed up %.0fs: its crash loop is over", i,
                   restarts.RESTART_STABLE_AFTER_S)
          self._publish_crash_loops()
      live = {p.sentinel: i for i, p in self._procs.items() if i not in due}
      timeout = max(0.0, min([_POLL_S, *(at - now for at in due.values())]))
      dead = mp.connection.wait(list(live), timeout=timeout)
      self._log_restarts()  # before the exit they explain
      if not dead:
        self._watch_fork_server(live.values(), time.monotonic())
      for sentinel in dead:
        if self._stop.is_set():
          break
        i = live[sentinel]
        due[i] = time.monotonic() + self._note_death(i)

  def _watch_fork_server(self, live: Any, now: float) -> None:
    """Kills the fork server once it has left a worker's death unreported
    (or stayed stopped) for FORK_SERVER_TIMEOUT_S: the supervisor learns of
    deaths only through it."""
    for i in live:
      if _running(self._procs[i].pid):
        self._unreported.pop(i, None)
      else:
        self._unreported.setdefault(i, now)
    if _stopped(_fork_server_pid()):
      self._unreported.setdefault(-1, now)
    else:
      self._unreported.pop(-1, None)
    if self._unreported and now - min(self._unreported.values()) > FORK_SERVER_TIMEOUT_S:
      why = ("is stopped" if -1 in self._unreported
             else f"has not reported the exit of worker {min(self._unreported)}")
      _kill_fork_server(f"{why} for {FORK_SERVER_TIMEOUT_S:g}s")
      self._unreported.clear()

  def _crash_file(self, index: int) -> str | None:
    return os.path.join(self._crash_dir, f"w{index}.txt") if self._crash_dir else None

  def _crash_report(self, index: int) -> tuple[int | None, str]:
    """(the thread that got a fatal signal, its stack) from worker `index`'s
    faulthandler; (None, "") without one. Emptied: the next worker's own."""
    path = self._crash_file(index)
    if path is None:
      return None, ""
    try:
      with open(path, "rb") as f:
        text = f.read(_CRASH_REPORT_BYTES).decode(errors="replace")
      os.truncate(path, 0)
    except OSError:
      return None, ""
    match = re.search(r"^Current thread (0x[0-9a-f]+) \(most recent call first\):\n"
                      r"((?:  .*\n?)*)", text, re.M)
    if match is None:
      return None, ""
    return int(match.group(1), 16), match.group(2).rstrip()

  def _blame(self, index: int, code: int | None, why: str) -> str | None:
    """The step whose making killed worker `index`, posted as failed for
    every worker (step_board.py); None if no step is to blame. A fatal
    signal (faulthandler names the thread) blames the step that thread was
    making; one step in flight is blamed for a fatal signal at once, for
    another death (SIGKILL: the OOM killer, or an operator) the second time."""
    taken = self._steps.taken(index)
    self._steps.clear(index)
    thread, stack = self._crash_report(index)
    fatal = code is not None and code < 0 and -code in _CRASH_SIGNALS
    if fatal and thread is not None:
      blamed = [t for t in taken if t[1] == thread]
    else:
      blamed = taken if len(taken) == 1 else []
    if stack:
      log.error("worker %d %s; the stack of its thread that got it:\n%s", index, why, stack)
    for key, _, step in blamed:
      if len(self._strikes) >= 4 * step_board.MAX_FAILED_STEPS:  # bounded
        self._strikes.clear()
      strikes = self._strikes[key] = self._strikes.get(key, 0) + 1
      if fatal or strikes >= 2:
        self._steps.post(key, f"worker {index} {why}")
        return step
    return None

  def _note_death(self, index: int) -> float:
    """Logs why worker `index` died; returns the delay before its restart."""
    p = self._procs[index]
    p.join(FORK_SERVER_TIMEOUT_S)  # its sentinel said it ended: at once
    self._unreported.pop(index, None)
    self._health_board.reset(index)
    if self._metrics:
      self._metrics.worker_died(p.pid)
    if math.isinf(self._activity[index].value):  # its requests ended with it
      self._activity[index].value = time.monotonic()
    history = self._history[index]
    code = p.exitcode
    why = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
           else f"exited with code {code}")
    step = None
    if (code == _LOST_STATUS or code is None) and _running(p.pid):
      os.kill(p.pid, signal.SIGKILL)  # its fork server died, holding its status: no two workers in one slot
      why = "lost its fork server, and was killed"
      self._steps.clear(index)
    else:
      step = self._blame(index, code, why)
    # A death whose step is known, and refused from now on, is not the slot's
    # trouble: no longer delay, no crash loop.
    delay = history.died(time.monotonic(), explained=step is not None)
    if step is not None:
      log.error("worker %d (pid %s) %s making %s; that step is refused from now on "
                "(DATA_LOSS), by every worker; restarting it in %.1fs", index, p.pid, why,
                step, delay)
    elif history.crash_loop:
      log.error("worker %d (pid %s) %s; restarting it in %.1fs; crash loop: died %d "
                "times in a row, each within %.0fs of its start", index, p.pid, why,
                delay, history.deaths, restarts.RESTART_STABLE_AFTER_S)
    else:
      log.warning("worker %d (pid %s) %s; restarting it in %.1fs", index, p.pid, why, delay)
    self._publish_crash_loops()
    return delay

  def _publish_crash_loops(self) -> None:
    """Tells the workers how many slots are crash-looping (health)."""
    looping = sum(h.crash_loop for h in self._history.values())
    self._crash_loop.set(looping)
    self._health_board.set_reason("crash loop", looping > 0)

  def _log_restarts(self) -> None:
    """Logs what restarted workers reported at start-up: serving again, or
    the failure (they then exit, and are restarted after their backoff)."""
    for i in sorted(self._ready):
      report = self._report(i)
      if report is None:
        continue
      if report[1] is not None:
        log.error("worker %d failed to restart: %s", i, report[1])
      else:
        log.info("worker %d (pid %s) is serving again", i, self._procs[i].pid)

  def stop(self) -> None:
    """Health NOT_SERVING; SIGTERM every worker, wait out their grace period,
    then SIGKILL."""
    if self._health_board is not None:
      self._health_board.set_reason("stopping", True)
    self._stop.set()
    if self._supervisor is not None and self._supervisor is not threading.current_thread():
      self._supervisor.join(SUPERVISOR_JOIN_TIMEOUT_S)
      if self._supervisor.is_alive():
        log.error("the supervise thread did not stop within %gs; stopping the workers "
                  "without it", SUPERVISOR_JOIN_TIMEOUT_S)
    if _stopped(_fork_server_pid()):  # it would report no worker's exit
      _kill_fork_server("is stopped while the server stops")
    for p in self._procs.values():
      if _running(p.pid):
        p.terminate()
    # A worker just forked ignores SIGTERM until its first line runs (the
    # fork server's own setting, lifeline.start_worker): one that a restart
    # started as the stop began lost its SIGTERM and served on until the
    # SIGKILL. So it is sent again while they are awaited; a worker's
    # handler only sets its stop event, so a second one changes nothing.
    deadline = time.monotonic() + self.options.grace_s + 5.0
    self._await_exits(deadline, resend=signal.SIGTERM)
    for p in self._procs.values():
      if _running(p.pid):
        p.kill()
    self._await_exits(time.monotonic() + FORK_SERVER_TIMEOUT_S)
    for i, p in self._procs.items():
      if _running(p.pid):
        log.error("worker %d (pid %s) is still running after SIGKILL", i, p.pid)
    for reader in self._ready.values():
      reader.close()
    self._ready.clear()
    if self._metrics:
      self._metrics.stop()
    if self._health_port is not None:
      self._health_port.stop()
    if self._head_peers is not None:
      self._head_peers.remove()
    if self._crash_dir is not None:
      shutil.rmtree(self._crash_dir, ignore_errors=True)

  def _await_exits(self, deadline: float, resend: int | None = None) -> None:
    """Until every worker's exit is reported, or `deadline`; `resend`: a
    signal sent again to those still running every _RESEND_S. A worker gone
    by /proc may not be reported yet (its fork server reaps it a moment
    later), so it is waited for too: a stopped fork server, which never
    reports, was killed before (its workers then read as lost at once)."""
    sent = time.monotonic()
    while time.monotonic() < deadline:
      running = [p for p in self._procs.values() if p.is_alive()]
      if not running:
        return
      if resend is not None and time.monotonic() - sent >= _RESEND_S:
        sent = time.monotonic()
        for p in running:
          if _running(p.pid):
            os.kill(p.pid, resend)
      mp.connection.wait([p.sentinel for p in running],
                         timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))

  def __enter__(self) -> "Server":
    return self.start()

  def __exit__(self, *exc: object) -> None:
    self.stop()


# The line `serve` prints once every worker is ready; tools/testing/launcher.py reads
# the addresses from it.
_READY = re.compile(r" on (\S+):(\d+) with \d+ worker processes(?:, bulk port (\d+))?"
                    r"(?:, health port (\d+))? ")


class Ready(NamedTuple):
  """What a ready line says: where the server serves."""
  host: str
  port: int
  bulk_port: int | None
  health_port: int | None


def ready_line(server: Server) -> str:
  names = ", ".join(sorted(server.config.datasets)) if server.config else ""
  bulk = f", bulk port {server.bulk_port}" if server.bulk_port is not None else ""
  metrics = (f"; metrics at http://{server.host}:{server.metrics_port}/metrics"
             if server.metrics_port is not None else "")
  return (f"elevator: serving [{names}] on {server.host}:{server.port} with "
          f"{server.num_workers} worker processes{bulk}, health port {server.health_port} "
          f"(pid {os.getpid()}){metrics}")


def parse_ready_line(line: str) -> Ready | None:
  """Where a ready line says the server serves; None for any other line."""
  match = _READY.search(line)
  if not match:
    return None
  bulk, health = match.group(3), match.group(4)
  return Ready(match.group(1), int(match.group(2)), int(bulk) if bulk else None,
               int(health) if health else None)


def serve(config: str | os.PathLike[str], options: ServerOptions = ServerOptions()) -> int:
  """Runs a server until SIGINT/SIGTERM; returns the process exit code.
  Owns its process: puts WORKER_ENV's defaults in its environment first,
  before any thread runs, and starts the fork server at once, so that its
  imports overlap the config's checks."""
  for k, v in WORKER_ENV.items():
    os.environ.setdefault(k, v)
  mp.set_forkserver_preload(_PRELOAD)
  try:
    _fork_server_running()
  except OSError:
    pass  # the first worker's start says why, and spawns instead
  server = Server(config, options)
  # SIGTERM and SIGINT are heard through the signal module's wakeup fd; their
  # handlers do nothing. A handler that takes a lock (an Event's set) hangs
  # the process for good when a second signal lands while the first handler
  # holds it: a supervisor sent SIGTERM twice was seen never to stop.
  wake, wake_in = socket.socketpair()
  wake.setblocking(False)
  wake_in.setblocking(False)
  previous = signal.set_wakeup_fd(wake_in.fileno(), warn_on_full_buffer=False)
  for sig in _STOP_SIGNALS:
    signal.signal(sig, lambda *_: None)
  idle_exit_s = options.idle_exit_s
  try:
    server.start()
    print(ready_line(server), flush=True)
    try:
      while not _stop_signalled(wake, min(1.0, idle_exit_s or 1.0)):
        if idle_exit_s is not None and server.idle_s() >= idle_exit_s:
          print(f"elevator: no request for {idle_exit_s:g}s (--idle-exit-s): stopping",
                flush=True)
          break
    finally:
      server.stop()
  finally:
    signal.set_wakeup_fd(previous)
    wake.close()
    wake_in.close()
  print("elevator: stopped", flush=True)
  return 0


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop_signalled(wake: socket.socket, timeout_s: float) -> bool:
  """Whether SIGTERM or SIGINT arrived within `timeout_s` (or before): the
  wakeup fd carries the number of every signal Python handles."""
  if not select.select([wake], [], [], timeout_s)[0]:
    return False
  try:
    return any(sig in _STOP_SIGNALS for sig in wake.recv(4096))
  except BlockingIOError:
    return False
