"""Reads from a store that is slow at the tail and refuses past a rate: the
stand-in store (tools/testing/object_store.py) on 127.0.0.1, S3 and GCS,
with a long-tailed time to first byte (p50 2 ms, p99 400 ms) and a limit of
30 requests a second per prefix. Every step is exact, remote (H in {1, 2})
and embedded; the server asked stragglers again and backed off on the
refusals, which its metrics and the store's counts show."""

from __future__ import annotations

import pathlib
from typing import Any, Iterator

import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.pipelines import examples
from grain_elevator.server.data.storage.objects import HEDGE_BURST, HEDGE_SHARE
from grain_elevator.tools import top
from grain_elevator.tools.testing.object_store import StandInStore
import datasets
from helpers import assert_trees_equal, server_with_env

pytestmark = pytest.mark.slow  # a store process and a server per kind

G = 8
STEPS = 6
WORKERS = 2
IMAGE = {"height": 48, "width": 48, "channels": 3}
BUCKET = "tail"
SLOW_TAIL = {"ttfb_p50_ms": 2, "ttfb_p99_ms": 400, "max_rate": 30}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("tail-data")
  examples.write_image_shards(str(root / "shards"), num_records=400, num_shards=4, **IMAGE)
  return root


@pytest.fixture(scope="module", params=["s3", "gcs"])
def store(request, shards: pathlib.Path, tmp_path_factory) -> Iterator[StandInStore]:
  with StandInStore(tmp_path_factory.mktemp(f"store-{request.param}"), request.param,
                    **SLOW_TAIL) as s:
    s.create_bucket(BUCKET)
    for f in sorted((shards / "shards").glob("*.array_record")):
      s.put(BUCKET, f"img/{f.name}", f.read_bytes())
    yield s


def _config(shards: pathlib.Path, store: StandInStore) -> str:
  scheme = "s3" if store.kind == "s3" else "gs"
  return datasets.write_config(
      shards / f"{store.kind}.toml",
      img=datasets.images(f"{scheme}://{BUCKET}/img/*.array_record", image=IMAGE, seed=9,
                          num_epochs=3))


def _steps(ds: RemoteDataset) -> list[Any]:
  with ds:
    it = iter(ds)
    return [next(it) for _ in range(STEPS)]


def test_stragglers_and_refusals_cost_time_not_data(store, shards, monkeypatch):
  local = datasets.write_config(shards / "local.toml",
                                img=datasets.images(f"{shards}/shards/*.array_record",
                                                    image=IMAGE, seed=9, num_epochs=3))
  config = _config(shards, store)
  with server_with_env(config, store.env(), workers=WORKERS, metrics_port=0) as server:
    for k, v in store.env().items():  # embedded mode reads the store too
      monkeypatch.setenv(k, v)
    for hosts in (1, 2):
      for h in range(hosts):
        want = _steps(RemoteDataset.embedded(local, "img", G, shard_index=h, shard_count=hosts))
        for ds in (RemoteDataset(server.target, "img", G, shard_index=h, shard_count=hosts),
                   RemoteDataset.embedded(config, "img", G, shard_index=h, shard_count=hosts)):
          for step, (a, b) in enumerate(zip(_steps(ds), want)):
            assert_trees_equal(a, b, f"{store.kind} {ds.targets[0][:8]} host {h}/{hosts} "
                               f"step {step}")
    gets = {dict(labels)["outcome"]: v for (name, labels), v in
            top.scrape(f"127.0.0.1:{server.metrics_port}").items()
            if name == "elevator_storage_gets_total"}
  stats = store.stats()
  assert stats["refused"] > 0, stats  # the limit was met...
  assert gets.get("refused", 0) > 0 and gets.get("retried", 0) > 0, gets  # ...and retried
  assert gets.get("hedged", 0) > 0, gets  # stragglers were asked again
  # Within the hedge's share (5%, and a burst of 16 after a quiet spell),
  # which each worker keeps: both make steps (a request is a short time of
  # one worker's work, so consecutive steps go to both).
  assert gets["hedged"] <= HEDGE_SHARE * (gets["answered"] + gets.get("refused", 0)) + (
      HEDGE_BURST * WORKERS), gets
