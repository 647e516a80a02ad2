"""JAX processes of a multi-process job reading from a real server, stage
after stage.

Each process checks that every addressable shard of step k's global array
equals the oracle's rows, then saves the iterator with Grain's orbax
handler. Each `--stage` (JSON: processes, devices, args: the process's
flags below) is a job run after the one before: its processes are forks of
this launcher, which imported JAX, Grain, orbax and the client once before
any JAX backend, thread or connection (a fresh interpreter per process paid
those imports, ~5 CPU-seconds, each), and each gets `devices` CPU devices
(XLA_FLAGS, read when its backend starts) and its own coordinator port.
Process i of stage s writes its output to OUT/stage<s>-process<i>.log.
Run by tests/client/test_multihost.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import sys
import traceback

import numpy as np
# Imported before any process forks, so that none imports them again.
import grain
import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from grain_elevator.client import RemoteDataset, checkpoint, to_device
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.server.process import lifeline
# What EmbeddedBackend imports when it opens a config.
from grain_elevator.server.data import config as _config  # pylint: disable=unused-import
from grain_elevator.server.data import registry as _registry  # pylint: disable=unused-import
from grain_elevator.server.serving import request_path as _request_path  # pylint: disable=unused-import

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from helpers import oracle_batch  # pylint: disable=g-import-not-at-top


def run(argv: list[str]) -> int:
  """One process of the job."""
  p = argparse.ArgumentParser()
  p.add_argument("--coordinator", default="")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, default=96)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--checkpoint-dir", required=True)
  p.add_argument("--resume", action="store_true")
  args = p.parse_args(argv)

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.num_processes > 1:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  remote = RemoteDataset(args.target, args.dataset, args.global_batch_size)
  assert (remote.shard_index, remote.shard_count) == (jax.process_index(), jax.process_count())
  it = iter(to_device(remote, NamedSharding(mesh, P("data"))))
  manager = ocp.CheckpointManager(pathlib.Path(args.checkpoint_dir).resolve())
  start = 0
  if args.resume:
    step = manager.latest_step()
    checkpoint.restore(it, manager.directory / str(step) / "data")
    start = it.get_state()["step"]
  oracle = EmbeddedBackend(args.config)
  for k in range(start, start + args.steps):
    batch = next(it)
    expected = oracle_batch(oracle, args.dataset, k, args.global_batch_size)
    for key, array in batch.items():
      assert array.shape[0] == args.global_batch_size, array.shape
      want = np.asarray(jax.numpy.asarray(expected[key]))
      for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    print(f"process {jax.process_index()}/{jax.process_count()} "
          f"devices {jax.local_device_count()}: step {k} ok", flush=True)
  end = start + args.steps
  manager.save(end, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  manager.wait_until_finished()
  manager.close()
  remote.close()
  print(f"process {jax.process_index()}: saved step {end}", flush=True)
  return 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _fork(log: str, devices: int, argv: list[str]) -> int:
  """Process `argv` in a fork: its output to `log`, `devices` CPU devices;
  killed if the launcher dies."""
  launcher = os.getpid()
  pid = os.fork()
  if pid:
    return pid
  code = 1
  try:
    lifeline.tie(launcher, signal.SIGKILL)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    code = run(argv)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # none of the launcher's exit handlers


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True, help="folder of the processes' logs")
  p.add_argument("--stage", action="append", type=json.loads, required=True,
                 help='a job, e.g. {"processes": 2, "devices": 4, "args": ["--steps", "6"]}')
  a = p.parse_args()
  for s, stage in enumerate(a.stage):
    n = stage["processes"]
    job = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", str(n)]
    pids = [_fork(os.path.join(a.out, f"stage{s}-process{i}.log"), stage["devices"],
                  [*job, "--process-id", str(i), *stage["args"]]) for i in range(n)]
    codes: dict[int, int] = {}
    while len(codes) < n:
      pid, status = os.wait()
      codes[pid] = os.waitstatus_to_exitcode(status)
      if codes[pid]:  # the others may wait for it forever: they go too
        for other in set(pids) - set(codes):
          os.kill(other, signal.SIGKILL)
    if any(codes.values()):
      print(f"stage {s}: processes exited {[codes[pid] for pid in pids]}", flush=True)
      return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
