"""How a server serves a stream dataset: each global batch produced once for
all hosts, the head computed by every worker, and the stream exact across a
worker's death. In-process servers where they can be: `elevator serve`
processes for a TMPDIR of its own at start-up and for a replica SIGKILLed
whole."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading

import pytest

from grain_elevator.client import RemoteDataset, RetryPolicy, TransportOptions
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
from grain_elevator.tools.testing.launcher import LocalServer
from helpers import assert_streams_equal, worker_pids
import datasets

G, H, STEPS = 12, 3, 24

_PROBE = '''
import os
from grain_elevator.pipelines import examples


class _Noted:
  """examples' filter, noting which process computed each element."""

  def __init__(self, out):
    self.out = out

  def __call__(self, record):
    with open(os.path.join(self.out, f"{os.getpid()}.txt"), "a") as f:
      f.write(f"{int(record['id'])}\\n")
    return int(record["label"]) % 2 == 0


def even_labels(ds, *, out, height, width, channels):
  return examples.decode_images(ds, height=height, width=width, channels=channels).filter(
      _Noted(out))
'''


@pytest.fixture(scope="module")
def probe_config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("probe")
  (root / "probe_pipeline.py").write_text(_PROBE)
  (root / "notes").mkdir()
  datasets.write_config(root / "elevator.toml",
                        even=datasets.images(data_dir / datasets.SHARDS,
                                             pipeline="probe_pipeline:even_labels", seed=31,
                                             num_epochs=0, options={"out": str(root / "notes")}))
  return root / "elevator.toml"


def _env(config: pathlib.Path) -> dict[str, str]:
  return {"PYTHONPATH": str(config.parent)}


@pytest.fixture(scope="module")
def want(probe_config) -> list:
  os.environ["PYTHONPATH"] = str(probe_config.parent)  # embedded mode imports the pipeline
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(probe_config.parent))
  with RemoteDataset.embedded(str(probe_config), "even", G) as ds:
    it = iter(ds)
    return [next(it) for _ in range(STEPS + 40)]


def _rows(batch: dict, h: int) -> dict:
  return {k: v[h * G // H:(h + 1) * G // H] for k, v in batch.items()}


def test_every_worker_computes_the_head_of_a_stream(probe_config, want, tmp_path):
  """Under a TMPDIR too long for a Unix socket's path (a CI runner's, a
  pod's), where the workers meet anyway."""
  notes = probe_config.parent / "notes"
  long_tmp = tmp_path / ("t" * 110)
  long_tmp.mkdir()
  env = {**_env(probe_config), "TMPDIR": str(long_tmp)}
  with LocalServer(str(probe_config), workers=2, env=env) as server:
    workers = set(worker_pids(server))
    for f in notes.iterdir():  # what opening the dataset computed
      f.unlink()
    with RemoteDataset(server.target, "even", G) as ds:
      it = iter(ds)
      assert assert_streams_equal([next(it) for _ in range(STEPS)], want[:STEPS]) == STEPS
  computed_by = {int(f.stem) for f in notes.iterdir()}
  assert computed_by == workers, "the head's elements were computed by both workers"


def test_hosts_reading_together_get_each_global_batch_produced_once(probe_config, want):
  os.environ["PYTHONPATH"] = str(probe_config.parent)  # the Server's workers import it
  with Server(str(probe_config), ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    out: list[list] = [[] for _ in range(H)]
    start = threading.Barrier(H)

    def read(h: int) -> None:
      with RemoteDataset(server.target, "even", G, shard_index=h, shard_count=H, prefetch=4,
                         transport=TransportOptions(steps_per_request=4)) as ds:
        it = iter(ds)
        start.wait(30)
        out[h] = [next(it) for _ in range(STEPS)]

    threads = [threading.Thread(target=read, args=(h,)) for h in range(H)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    for h in range(H):
      assert assert_streams_equal(out[h], [_rows(b, h) for b in want[:STEPS]]) == STEPS
    m = top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=10)
  label = (("dataset", "even"),)
  served = m[("elevator_batches_total", label)]
  produced = m[("elevator_batch_seconds_count", label)]
  shared = m[("elevator_batch_cache_hits_total", label)]
  # Each host reads ahead at most one request (4 steps) past STEPS.
  assert H * STEPS <= served <= H * (STEPS + 4) and STEPS <= produced <= STEPS + 4
  assert shared == served - produced and shared >= (H - 1) * STEPS


@pytest.mark.slow  # kills workers and waits for their restart
def test_the_stream_stays_exact_when_its_workers_die(probe_config, want):
  """Each worker is SIGKILLed in turn, mid-stream: one of them owns the
  stream, the other computes part of its head. (Its workers import the
  pipeline from this process's path, which `want` extended.)"""
  with Server(str(probe_config), ServerOptions(port=0, workers=2)) as server:
    with RemoteDataset(server.target, "even", G, retry=RetryPolicy(timeout_s=60),
                       transport=TransportOptions(steps_per_request=3)) as ds:
      it = iter(ds)
      got = [next(it) for _ in range(10)]
      for pid in server.worker_pids():
        os.kill(pid, signal.SIGKILL)
        got += [next(it) for _ in range(15)]
      saved = json.loads(json.dumps(it.get_state()))
  assert assert_streams_equal(got, want[:STEPS + 16]) == STEPS + 16
  assert saved["step"] == STEPS + 16


@pytest.mark.slow  # starts two replicas, kills one
def test_the_stream_stays_exact_when_its_replica_dies(probe_config, want):
  """The replica serving the stream is SIGKILLed mid-stream: the other
  continues from the position of the last step received."""
  a = LocalServer(str(probe_config), workers=1, env=_env(probe_config))
  b = LocalServer(str(probe_config), workers=1, env=_env(probe_config))
  try:
    with RemoteDataset([a.target, b.target], "even", G, retry=RetryPolicy(timeout_s=60),
                       transport=TransportOptions(steps_per_request=3)) as ds:
      it = iter(ds)
      got = [next(it) for _ in range(10)]
      serving = {s.replica[0] for s in it._backend.data_slots()  # pylint: disable=protected-access
                 if s.served}
      assert len(serving) == 1, "one replica serves a stream"
      (victim,) = [s for s in (a, b) if s.target in serving]
      for pid in [victim.proc.pid, *worker_pids(victim)]:
        os.kill(pid, signal.SIGKILL)
      got += [next(it) for _ in range(STEPS + 30)]
  finally:
    a.stop()
    b.stop()
  assert assert_streams_equal(got, want[:STEPS + 40]) == STEPS + 40
