"""Small test helpers: reading whole streams and comparing pytrees bit for bit."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from grain_elevator.proto import dtypes
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent  # the checkout
SCRIPTS = TESTS / "scripts"  # programs the tests run as trainers


def assert_trees_equal(a: Any, b: Any, where: str = "") -> None:
  la, sa, pa = tree.flatten(a)
  lb, sb, _ = tree.flatten(b)
  assert sa == sb, f"{where}: structures differ: {sa} vs {sb}"
  for path, x, y in zip(pa, la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (
        f"{where} {path}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
    # Compare bytes, so NaNs and -0.0 count as bit differences too.
    assert x.tobytes() == y.tobytes(), f"{where} {path}: values differ"


def assert_leaves_equal(got: list[Any], want: list[Any], where: str) -> None:
  """Two flat lists of leaves (a batch as the wire carries it), bit for bit."""
  assert len(got) == len(want), where
  for i, (a, b) in enumerate(zip(got, want)):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where} leaf {i}"
    assert a.tobytes() == b.tobytes(), f"{where} leaf {i}"


def assert_streams_equal(a: Iterable[Any], b: Iterable[Any]) -> int:
  a, b = list(a), list(b)
  assert len(a) == len(b), f"stream lengths differ: {len(a)} vs {len(b)}"
  for k, (x, y) in enumerate(zip(a, b)):
    assert_trees_equal(x, y, f"step {k}")
  return len(a)


def oracle_batch(oracle, dataset: str, step: int, g: int, h: int = 0, n: int = 1) -> Any:
  """Host h of n's batch for `step`, computed in-process."""
  (info,) = oracle.describe(dataset)
  (got,) = oracle.fetch(pb.BatchRequest(
      dataset=dataset, global_batch_size=g, shard_index=h, shard_count=n,
      start_step=step, num_steps=1))
  return tree.unflatten(info.element_spec.structure, got.leaves)


def worker_pids(server) -> list[int]:
  """PIDs of a LocalServer's worker processes (named elevator-wN by
  lifeline.py; their parent is the fork server, the supervisor's child)."""
  import psutil  # pylint: disable=g-import-not-at-top
  try:
    family = psutil.Process(server.proc.pid).children(recursive=True)
  except psutil.NoSuchProcess:
    return []
  out = []
  for p in family:
    try:
      if p.name().startswith("elevator-w"):
        out.append(p.pid)
    except psutil.NoSuchProcess:
      pass
  return out


@contextlib.contextmanager
def server_with_env(config: str, env: dict[str, str], **options: Any) -> Iterator[Any]:
  """An in-process Server (`options`: ServerOptions, port 0) whose workers
  see `env` (a bucket's endpoint and keys): they take this process's
  environment as they start, which has it only then."""
  from grain_elevator.server import Server, ServerOptions  # pylint: disable=import-outside-toplevel
  from grain_elevator.tools.testing.storage_servers import environment  # pylint: disable=import-outside-toplevel
  with environment(env):
    server = Server(config, ServerOptions(port=0, **options)).start()
  try:
    yield server
  finally:
    server.stop()


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 60.0,
             every_s: float = 0.05) -> None:
  """Polls `condition` until it holds. The bound only ends a hang: it is far
  past what a loaded 2-core machine takes, and failing names `what`."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
    time.sleep(every_s)


def cpu_s(proc) -> float:
  """User + system CPU seconds of a psutil.Process."""
  return sum(proc.cpu_times()[:2])


def busy_cpu_rate(proc, cpu: float = 0.5, timeout_s: float = 60.0) -> float:
  """CPU seconds per second `proc` runs at while it works: measured over
  the time it takes to use `cpu` seconds, however long a loaded machine
  makes that."""
  start, began = cpu_s(proc), time.monotonic()
  wait_for(lambda: cpu_s(proc) - start >= cpu, f"pid {proc.pid} to use {cpu} CPU-s",
           timeout_s)
  return (cpu_s(proc) - start) / (time.monotonic() - began)


def cpu_rate_over(proc, seconds: float) -> float:
  """CPU seconds per second `proc` ran at over the next `seconds`."""
  start, began = cpu_s(proc), time.monotonic()
  time.sleep(seconds)
  return (cpu_s(proc) - start) / (time.monotonic() - began)


def wait_for_log(server, text: str, timeout_s: float = 60.0) -> str:
  """A LocalServer's log once it holds `text` (its reader thread reads the
  server's stderr a moment after the server writes it)."""
  wait_for(lambda: text in server.stderr(), f"the server to log {text!r}", timeout_s)
  return server.stderr()


def proto_batch(step: int, leaves: list[np.ndarray]) -> pb.Batch:
  """A Batch built with protobuf's own objects: the reference the hand-written
  encoder (proto/wire.py) must equal byte for byte."""
  tensors = []
  for a in leaves:
    a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">"
                             else a)
    tensors.append(pb.Tensor(dtype=dtypes.dtype_to_str(a.dtype), shape=a.shape,
                             data=a.tobytes()))
  return pb.Batch(step=step, leaves=tensors)


def proto_leaves(batch: pb.Batch) -> list[np.ndarray]:
  """A Batch's tensors read through protobuf's own objects (the reference
  decoder), zstd frames decompressed."""
  import zstandard  # pylint: disable=g-import-not-at-top
  out = []
  for t in batch.leaves:
    data = t.data
    if t.compression == pb.COMPRESSION_ZSTD:
      data = zstandard.ZstdDecompressor().decompress(data)
    out.append(np.frombuffer(data, dtype=dtypes.dtype_from_str(t.dtype)).reshape(t.shape))
  return out


def run_bench(module: str, *args: str, timeout_s: float = 600) -> str:
  """Runs `python -m grain_elevator.tools.bench.<module> ARGS`; its stdout,
  after checking it exited 0 (else its stderr's end is the failure)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  result = subprocess.run(
      [sys.executable, "-m", f"grain_elevator.tools.bench.{module}", *args],
      capture_output=True, text=True, timeout=timeout_s)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def closed_by_peer(s: socket.socket) -> bool:
  """Reads to the end: True once the peer hung up (EOF or reset); the
  socket's own timeout raises if it never does."""
  try:
    while s.recv(65536):
      pass
  except ConnectionResetError:
    pass
  return True


# -- what a converter wrote ---------------------------------------------------


def read_shards(out_dir: pathlib.Path) -> list[bytes]:
  """Every record of the ArrayRecord shards in `out_dir`, in shard-name order."""
  from array_record.python.array_record_data_source import ArrayRecordDataSource  # pylint: disable=g-import-not-at-top
  files = sorted(str(p) for p in out_dir.glob("*.array_record"))
  source = ArrayRecordDataSource(files)
  return [source[i] for i in range(len(source))]


def shard_bytes(out_dir: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


def no_leftovers(out_dir: pathlib.Path) -> None:
  """A failed conversion left neither the output nor its hidden staging folder."""
  assert not out_dir.exists()
  hidden = [p.name for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]
  assert not hidden, hidden


# The Beam venv `make test` built (.venv-beam; `make test-newest` builds another).
BEAM_PYTHON = pathlib.Path(os.environ.get("ELEVATOR_BEAM_VENV", ROOT / ".venv-beam"),
                           "bin", "python")


def beam_python() -> str:
  """The Beam venv's Python (`make beam-venv`), or the test is skipped saying why."""
  import pytest  # pylint: disable=g-import-not-at-top
  if not BEAM_PYTHON.exists():
    pytest.skip(f"{BEAM_PYTHON} is missing: `make beam-venv` builds it (make test tries)")
  probe = subprocess.run([str(BEAM_PYTHON), "-c", "import apache_beam, array_record"],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    pytest.skip(f"{BEAM_PYTHON} cannot import apache_beam: {probe.stderr.strip()[-300:]}")
  return str(BEAM_PYTHON)


def run_beam(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """`python -m grain_elevator.tools.convert.beam ARGS --runner DirectRunner`."""
  return subprocess.run(
      [beam_python(), "-m", "grain_elevator.tools.convert.beam", *args,
       "--runner", "DirectRunner"],
      capture_output=True, text=True, check=False, cwd=ROOT, timeout=300,
      env=None if env is None else {**os.environ, **env})



def run_fuzzer(fuzzer: pathlib.Path, seconds: int, out: pathlib.Path, *args: str) -> str:
  """A bounded run of one of tests/fuzz/'s fuzzers (`make fuzz` runs them
  longer): its output, once it exited 0 reporting 0 findings."""
  result = subprocess.run(
      [sys.executable, str(fuzzer), "--seconds", str(seconds), "--seed", "17", *args,
       "--out", str(out)],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert re.search(r"inputs in \d+ s, 0 findings$", result.stdout.rstrip()), \
      result.stdout[-3000:]
  return result.stdout


def probe(target: str, timeout_s: float = 5.0) -> int | None:
  """A health Check as the kubelet makes one (a fresh connection, one call):
  its status, or None without an answer within `timeout_s`."""
  import grpc  # pylint: disable=g-import-not-at-top
  from grpc_health.v1 import health_pb2, health_pb2_grpc  # pylint: disable=g-import-not-at-top
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    try:
      return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=timeout_s).status
    except grpc.RpcError:
      return None
