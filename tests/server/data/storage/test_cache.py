"""The tier-side cache (`--cache-dir`), against real protocol servers on
127.0.0.1 behind a fault-injecting proxy: a warm cache serves the exact
stream with the bucket's GETs down; a cold one serves it exact while it
fills; a partial one serves what it holds and reads the rest; a replaced
object is refused or served as recorded, never mixed, and a restart takes
the new bytes; a restart reuses what was cached, with no GET of a record."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from grain_elevator.client import RemoteDataset, StreamMismatchError
from grain_elevator.pipelines import examples
from grain_elevator.server.data.storage import cache as cache_lib
import datasets
from helpers import assert_trees_equal, server_with_env, wait_for

pytestmark = pytest.mark.slow  # S3 and GCS emulators

G = 8
STEPS = 6
IMAGE = {"height": 64, "width": 64, "channels": 3}
SHARDS = 3  # of ~0.57 MB each: a 1 MiB cache holds one


def _blocks(root: pathlib.Path) -> dict[str, int]:
  """Whole blocks on disk, per object URL (as the cache's object.json names it)."""
  import json
  out = {}
  for meta in (root / "objects").glob("*/*/object.json"):
    out[json.loads(meta.read_text())["url"]] = sum(
        1 for p in meta.parent.iterdir() if p.name[1:].isdigit())
  return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("cache-data")
  examples.write_image_shards(str(root / "shards"), num_records=120, num_shards=SHARDS, **IMAGE)
  examples.write_image_shards(str(root / "other"), num_records=120, num_shards=SHARDS, seed=3,
                              **IMAGE)
  return root


@pytest.fixture(scope="module")
def local_config(shards: pathlib.Path) -> str:
  return datasets.write_config(shards / "local.toml",
                               img=datasets.images(f"{shards}/shards/*.array_record",
                                                   image=IMAGE, seed=4))


def _config(shards: pathlib.Path, bucket, prefix: str) -> str:
  bucket.upload(shards / "shards", prefix)
  return datasets.write_config(
      shards / f"{bucket.kind}-{prefix}.toml",
      img=datasets.images(f"{bucket.url(prefix)}/*.array_record", image=IMAGE, seed=4))


def _server(config: str, bucket, **options: Any):
  return server_with_env(config, bucket.env(), **options)


def _steps(target: str, n: int = STEPS, h: int = 0, hosts: int = 1) -> list[Any]:
  with RemoteDataset(target, "img", G, shard_index=h, shard_count=hosts) as ds:
    it = iter(ds)
    return [next(it) for _ in range(n)]


def _oracle(config: str, h: int = 0, hosts: int = 1) -> list[Any]:
  with RemoteDataset.embedded(config, "img", G, shard_index=h, shard_count=hosts) as ds:
    it = iter(ds)
    return [next(it) for _ in range(STEPS)]


def _assert_exact(got: list[Any], want: list[Any], what: str) -> None:
  for step, (a, b) in enumerate(zip(got, want, strict=True)):
    assert_trees_equal(a, b, f"{what} step {step}")


def test_a_warm_cache_serves_the_stream_with_the_buckets_reads_down(
    bucket, shards, local_config, tmp_path):
  """Filled from start with no read asked; then every GET is refused, and
  the stream is still exact, for H in {1, 2}: its records are read locally."""
  config = _config(shards, bucket, "warm")
  with _server(config, bucket, workers=2, cache_dir=str(tmp_path)) as server:
    wait_for(lambda: sum(_blocks(tmp_path).values()) == SHARDS, "the cache to fill")
    bucket.proxy.faults_only_for = lambda method, path: method == "GET"
    bucket.proxy.outage(600, "503")
    try:
      for hosts in (1, 2):
        for h in range(hosts):
          _assert_exact(_steps(server.target, h=h, hosts=hosts), _oracle(local_config, h, hosts),
                        f"host {h}/{hosts}")
    finally:
      bucket.proxy.clear()
    assert len(server.worker_pids()) == 2


def test_a_cold_cache_serves_the_stream_while_it_fills_then_a_restart_reads_no_record(
    bucket, shards, local_config, tmp_path):
  config = _config(shards, bucket, "cold")
  want = _oracle(local_config)
  with _server(config, bucket, workers=2, cache_dir=str(tmp_path)) as server:
    _assert_exact(_steps(server.target), want, "cold")
    wait_for(lambda: sum(_blocks(tmp_path).values()) == SHARDS, "the cache to fill")
  # A new server on the same folder: it reads each object's identity and
  # footer at start, and no record from the bucket.
  before = bucket.proxy.stats.ranged_gets
  with _server(config, bucket, workers=1, cache_dir=str(tmp_path)) as server:
    opened = bucket.proxy.stats.ranged_gets - before
    _assert_exact(_steps(server.target), want, "restarted")
    assert bucket.proxy.stats.ranged_gets - before == opened


def test_a_partial_cache_serves_what_it_holds_and_reads_the_rest(
    bucket, shards, local_config, tmp_path):
  config = _config(shards, bucket, "partial")
  with _server(config, bucket, workers=1, cache_dir=str(tmp_path), cache_mb=1) as server:
    wait_for(lambda: sum(_blocks(tmp_path).values()) == 1, "the cache to fill what fits")
    _assert_exact(_steps(server.target), _oracle(local_config), "partial")
    assert sum(_blocks(tmp_path).values()) == 1  # full: nothing more was written
    assert cache_lib.ObjectCache(tmp_path, 1 << 20).usage() <= 1 << 20


def test_a_replaced_object_is_refused_or_served_as_recorded_never_mixed(
    bucket, shards, local_config, tmp_path):
  """A 1 MiB cache holds one shard; then it and another, not cached, are
  replaced. Each step is exact (the bytes the server started with) or
  refused naming the shard not cached. A restart on the same folder records
  the new bytes: its stream is theirs, and the old blocks are gone."""
  config = _config(shards, bucket, "replace")
  names = [f"train-0000{s}-of-00003.array_record" for s in range(SHARDS)]
  with _server(config, bucket, workers=1, cache_dir=str(tmp_path), cache_mb=1) as server:
    wait_for(lambda: sum(_blocks(tmp_path).values()) == 1, "the cache to fill what fits")
    (cached,) = [n for n in names if _blocks(tmp_path).get(bucket.url(f"replace/{n}"))]
    uncached = next(n for n in names if n != cached)
    for name in (cached, uncached):
      bucket.put(f"replace/{name}", (shards / "other" / name).read_bytes())
    want = _oracle(local_config)
    refused = 0
    for step in range(STEPS):
      try:
        with RemoteDataset(server.target, "img", G, prefetch=0) as ds:
          it = iter(ds)
          it.set_state({**it.get_state(), "step": step})
          got = next(it)
      except StreamMismatchError as e:
        assert f"shard {bucket.url('replace/' + uncached)} changed" in str(e), e
        refused += 1
      else:
        assert_trees_equal(got, want[step], f"step {step}")
    assert refused >= 1
  replaced = shards / "replaced"
  replaced.mkdir(exist_ok=True)
  for name in names:
    (replaced / name).write_bytes(
        (shards / ("other" if name in (cached, uncached) else "shards") / name).read_bytes())
  new = datasets.write_config(shards / "replaced.toml",
                              img=datasets.images(f"{replaced}/*.array_record", image=IMAGE,
                                                  seed=4))
  with _server(config, bucket, workers=1, cache_dir=str(tmp_path), cache_mb=1) as server:
    _assert_exact(_steps(server.target), _oracle(new), "after the restart")
  folders = list((tmp_path / "objects").glob("*/*/object.json"))
  assert len(folders) == len({f.parent.parent for f in folders})  # one identity per object
