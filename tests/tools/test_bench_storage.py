"""`elevator bench --storage s3`: its two peers (local Grain reading a bucket
record by record, and through a whole-shard cache) read exactly the records
of the local shards from moto's S3 server; end to end on tiny sizes, every
system reports its figures and the goals are stated. No timing is asserted.

The end-to-end run's steps are G=8 records (--global-batch-size), not the
small workload's 256: local Grain's 16 read threads fetch 32 steps ahead,
each record a ranged GET or two that moto serves by copying its shard, so
at G=256 that peer alone made ~16,000 requests for one run of 0.3 s."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.tools.bench import bucket_sources
from grain_elevator.tools.testing import storage_servers
from grain_elevator.tools.testing.fault_proxy import FaultProxy
from grain_elevator.tools.testing.launcher import ELEVATOR

BUCKET = "elevator-bench-test"


@pytest.fixture(scope="module")
def s3():
  try:
    server = storage_servers.S3Server()
  except storage_servers.ServerUnavailable as e:
    pytest.skip(f"moto cannot run here ({e}); `make test` installs it")
  with server:
    server.create_bucket(BUCKET)
    yield server


def test_the_peers_read_the_records_of_the_local_shards(s3, tmp_path, monkeypatch):
  examples.write_image_shards(str(tmp_path), num_records=120, num_shards=4, height=16,
                              width=16, channels=3)
  files = sorted(str(p) for p in tmp_path.glob("*.array_record"))
  for f in files:
    s3.put(BUCKET, f"peers/{os.path.basename(f)}", pathlib.Path(f).read_bytes())
  urls = [f"s3://{BUCKET}/peers/{os.path.basename(f)}" for f in files]
  local = BatchedArrayRecordSource(files)
  order = [(k * 37) % 120 for k in range(120)]  # every record, shards interleaved
  with FaultProxy(s3.url) as proxy:
    for k, v in s3.env(proxy.url).items():
      monkeypatch.setenv(k, v)
    per_record = bucket_sources.PerRecordSource(urls)
    gets = proxy.stats.ranged_gets
    assert [per_record[i] for i in order] == [local[i] for i in order]
    assert proxy.stats.ranged_gets - gets >= len(order) // 2  # a read per record, about
    shard_bytes = [os.path.getsize(f) for f in files]
    cache = bucket_sources.ShardCacheSource(urls, str(tmp_path / "cache"),
                                            limit_bytes=2 * max(shard_bytes))
    assert len(cache) == len(local)
    assert [cache[i] for i in order] == [local[i] for i in order]
    # Two shards fit: interleaved reads download shards again and again.
    assert cache.downloaded_bytes > sum(shard_bytes)
    assert len(os.listdir(tmp_path / "cache")) <= 2


G = 8  # records a step in the end-to-end run


@pytest.mark.slow
def test_bench_storage_reports_every_system(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--storage", "s3", "--workloads", "small", "--small-records", "600",
       "--workers", "1", "--repeats", "1", "--seconds", "0.3", "--warmup", "0.1",
       "--storage-latency-ms", "5", "--global-batch-size", str(G),
       "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  wl = report["workloads"]["small"]
  assert wl["global_batch_size"] == G
  assert (f"600 records of {wl['record_bytes']:,} B stored, 2 shards, G={G};"
          in result.stdout)
  systems = wl["systems"]
  assert set(systems) == {"local", "bucket", "bucket_noplan", "grain_per_record",
                          "grain_shard_cache"}
  for key, row in systems.items():
    (run,) = row["runs"]
    assert run["records_per_s"] > 0 and run["records_total"] > 0, key
    assert run["resume_first_batch_s"] > 0, key
    if key == "local":
      assert run["storage_bytes"] == 0 and run["amplification"] is None
    else:
      assert run["storage_bytes"] > 0 and run["amplification"] > 0, key
  assert "goal ≥ 0.8" in result.stdout and "goal ≤ 1.5" in result.stdout
