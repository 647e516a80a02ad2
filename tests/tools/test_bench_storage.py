"""`elevator bench --storage s3`: its two peers (local Grain reading a bucket
record by record, and through a whole-shard cache, in Grain's order or in
its own windowed shuffle) read exactly the records of the local shards from
the stand-in S3 store; end to end on tiny sizes, every system reports its
figures, the store's ceiling is printed and the goals are stated. No timing
is asserted.

The end-to-end run's steps are G=8 records (--global-batch-size), not the
small workload's 256: a smoke run's steps, a few seconds in all."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from grain_elevator.pipelines import examples
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.tools.bench import bucket_sources
from grain_elevator.tools.bench import buckets
from grain_elevator.tools.testing.launcher import ELEVATOR
from grain_elevator.tools.testing.object_store import StandInStore

BUCKET = "elevator-bench-test"
pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
  with StandInStore(tmp_path_factory.mktemp("store"), "s3", ttfb=0) as store:
    store.create_bucket(BUCKET)
    yield store


def test_the_peers_read_the_records_of_the_local_shards(s3, tmp_path, monkeypatch):
  examples.write_image_shards(str(tmp_path), num_records=120, num_shards=4, height=16,
                              width=16, channels=3)
  files = sorted(str(p) for p in tmp_path.glob("*.array_record"))
  for f in files:
    s3.put(BUCKET, f"peers/{os.path.basename(f)}", pathlib.Path(f).read_bytes())
  urls = [f"s3://{BUCKET}/peers/{os.path.basename(f)}" for f in files]
  local = BatchedArrayRecordSource(files)
  order = [(k * 37) % 120 for k in range(120)]  # every record, shards interleaved
  for k, v in s3.env().items():
    monkeypatch.setenv(k, v)
  per_record = bucket_sources.PerRecordSource(urls)
  gets = s3.stats()["ranged_gets"]
  assert [per_record[i] for i in order] == [local[i] for i in order]
  assert s3.stats()["ranged_gets"] - gets >= len(order) // 2  # a read per record, about
  shard_bytes = [os.path.getsize(f) for f in files]
  cache = bucket_sources.ShardCacheSource(urls, str(tmp_path / "cache"),
                                          limit_bytes=2 * max(shard_bytes))
  assert len(cache) == len(local)
  assert [cache[i] for i in order] == [local[i] for i in order]
  # Two shards fit: interleaved reads download shards again and again.
  assert cache.downloaded_bytes > sum(shard_bytes)
  assert len(os.listdir(tmp_path / "cache")) <= 2
  # A windowed shuffle: every record once an epoch, each shard downloaded once.
  windowed = bucket_sources.ShardCacheSource(urls, str(tmp_path / "windowed"),
                                             limit_bytes=sum(shard_bytes),
                                             window_fraction=0.25, seed=3)
  got = [windowed[k] for k in range(len(local))]
  assert sorted(got) == sorted(local[i] for i in range(len(local)))
  assert got != [local[i] for i in range(len(local))]
  assert windowed.downloaded_bytes == sum(shard_bytes)


def test_a_windowed_order_shuffles_within_windows():
  order, windows = bucket_sources.windowed_order([10, 10, 10, 10], window=10, seed=1)
  assert sorted(order) == list(range(40))
  for w, shards in enumerate(windows):  # shard-aligned windows: one shard each
    (shard,) = shards
    assert sorted(order[w * 10:(w + 1) * 10]) == list(range(shard * 10, shard * 10 + 10))
  order, windows = bucket_sources.windowed_order([10, 10, 10, 10], window=15, seed=1)
  assert sorted(order) == list(range(40))
  assert [len(s) for s in windows] == [2, 2, 1]  # 0-15: A and B, 15-30: B and C, 30-40: D


def test_shards_are_about_64_mb_and_at_least_four():
  assert buckets.shard_count(200_000, 3_088) == 10
  assert buckets.shard_count(4_000, 114_008) == 7
  assert buckets.shard_count(600, 3_088) == 4
  assert buckets.shard_count(3, 3_088) == 3


G = 8  # records a step in the end-to-end run


@pytest.mark.slow
def test_bench_storage_reports_every_system(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--storage", "s3", "--workloads", "small", "--small-records", "600",
       "--workers", "1", "--repeats", "1", "--seconds", "0.3", "--warmup", "0.1",
       "--storage-ttfb-ms", "5,20", "--pace", "5000", "--storage-max-rate", "100000",
       "--global-batch-size", str(G),
       "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  wl = report["workloads"]["small"]
  assert wl["global_batch_size"] == G
  assert wl["shards"] == 4
  assert (f"600 records of {wl['record_bytes']:,} B stored, 4 shards of "
          f"{wl['shard_bytes'] / 2**20:.1f} MiB, G={G};" in result.stdout), result.stdout[:600]
  assert "The store answers" in result.stdout and "GETs/s here" in result.stdout
  assert wl["ceiling"]["gets_per_s"] > 0 and wl["pace"] == 5000
  systems = wl["systems"]
  assert set(systems) == {"local", "bucket", "cache_cold", "cache_warm", "grain_per_record",
                          "grain_shards"}
  for key, row in systems.items():
    (run,) = row["runs"]
    assert run["records_per_s"] > 0 and run["records_total"] > 0, key
    assert run["resume_first_batch_s"] > 0, key
    assert run["probe"]["records"] > 0, key
    if key == "local":
      assert run.get("gets_per_record") is None
    else:
      assert run["gets_per_record"] is not None and run["in_flight_peak"] >= 0, key
  (plan,) = systems["bucket"]["runs"]
  # 600 records: the plan may have read them all before the window began.
  assert plan["amplification"] >= 0 and plan["cost_per_tb"] >= 0
  assert plan["server"]["gets_answered"] > 0
  assert wl["warm_fill"]["held"] == wl["warm_fill"]["wanted"] > 0
  (warm,) = systems["cache_warm"]["runs"]
  assert warm["cache_hit_ratio"] == 1.0
  for goal in ("goal ≥ 0.8", "goal ≥ 1:", "goal ≤ 1.1", "goal ≥ 5", "goal ≥ 0.95",
               "goal ≥ 0.9:", "not judged in this run: CPU per record"):
    assert goal in result.stdout, goal
