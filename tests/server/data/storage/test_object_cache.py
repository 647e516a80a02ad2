"""ObjectCache on real files, no bucket: what a block holds is read back
exact, across block boundaries; a block of the wrong size, a dead filler's
claim and another identity of the object are never read; the limit holds
across the processes that share a folder."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.storage import cache as cache_lib
from grain_elevator.server.data.storage.objects import ObjectRef
from grain_elevator.server.data.storage.settings import StorageSettings

B = cache_lib.BLOCK_BYTES


def _obj(size: int, etag: str = '"e1"') -> ObjectRef:
  return ObjectRef("s3://b/k/x.array_record", StorageSettings(), size, etag, None)


@pytest.fixture
def data() -> bytes:
  return np.random.default_rng(0).integers(0, 256, 2 * B + 1000, np.uint8).tobytes()


def _fill(cache: cache_lib.ObjectCache, obj: ObjectRef, data: bytes, *blocks: int) -> None:
  for b in blocks:
    assert cache.claim(obj, b) == "mine"
    cache.fill(obj, b, data[b * B:b * B + cache.block_size(obj, b)])


def test_held_extents_are_read_back_exact_and_the_rest_are_missing(tmp_path, data):
  cache = cache_lib.ObjectCache(tmp_path, 1 << 30)
  obj = _obj(len(data))
  _fill(cache, obj, data, 0, 1)
  extents = [(5, 3005), (B - 100, B + 100), (2 * B + 10, 2 * B + 20)]
  got, missing = cache.take(obj, extents)
  assert {k: bytes(v) for k, v in got.items()} == {a: data[a:b] for a, b in extents[:2]}
  assert missing == [extents[2]]  # block 2 is not held
  assert cache.missing(obj, extents) == [extents[2]]
  assert cache.missing_blocks(obj, extents) == [2]
  assert cache.claim(obj, 0) == "held"
  assert cache.usage() == 2 * B


def test_a_block_of_the_wrong_size_is_dropped_and_read_from_the_bucket(tmp_path, data):
  cache = cache_lib.ObjectCache(tmp_path, 1 << 30)
  obj = _obj(len(data))
  _fill(cache, obj, data, 0)
  (block,) = (tmp_path / "objects").glob("*/*/b0")
  with open(block, "r+b") as f:
    f.truncate(B // 2)  # a torn write, or a disk that lost it
  fresh = cache_lib.ObjectCache(tmp_path, 1 << 30)
  got, missing = fresh.take(obj, [(B - 10, B - 5)])
  assert not got and missing == [(B - 10, B - 5)]


def test_another_identity_of_the_object_never_reads_the_old_blocks(tmp_path, data):
  cache = cache_lib.ObjectCache(tmp_path, 1 << 30)
  _fill(cache, _obj(len(data)), data, 0)
  replaced = _obj(len(data), etag='"e2"')
  got, missing = cache.take(replaced, [(0, 100)])
  assert not got and missing == [(0, 100)]
  assert len(list((tmp_path / "objects").glob("*/*/object.json"))) == 1  # the old one removed
  assert not list((tmp_path / "objects").glob("*/*/b0"))


def test_an_object_with_no_etag_or_generation_is_not_cached(tmp_path, data):
  cache = cache_lib.ObjectCache(tmp_path, 1 << 30)
  obj = ObjectRef("s3://b/k/y", StorageSettings(), len(data), None, None)
  assert not cache_lib.cacheable(obj)
  assert cache.take(obj, [(0, 10)]) == ({}, [(0, 10)])


_CLAIM_AND_DIE = """
import os, sys
from grain_elevator.server.data.storage import cache
from grain_elevator.server.data.storage.objects import ObjectRef
from grain_elevator.server.data.storage.settings import StorageSettings
obj = ObjectRef("s3://b/k/x.array_record", StorageSettings(), int(sys.argv[2]), '"e1"', None)
print(cache.ObjectCache(sys.argv[1], 1 << 30).claim(obj, 1), flush=True)
os._exit(0)  # dies holding the claim
"""


def test_a_dead_fillers_claim_is_taken_over_and_not_counted(tmp_path, data):
  done = subprocess.run([sys.executable, "-c", _CLAIM_AND_DIE, str(tmp_path), str(len(data))],
                        capture_output=True, text=True, timeout=120, check=True)
  assert done.stdout.strip() == "mine"
  assert list((tmp_path / "objects").glob("*/*/b1.claim"))
  cache = cache_lib.ObjectCache(tmp_path, 1 << 30)  # recounts: the dead claim is gone
  assert cache.usage() == 0
  assert cache.claim(_obj(len(data)), 1) == "mine"


def test_the_limit_holds_and_a_full_cache_says_so(tmp_path, data):
  cache = cache_lib.ObjectCache(tmp_path, B + B // 2)
  obj = _obj(len(data))
  _fill(cache, obj, data, 0)
  assert cache.claim(obj, 1) == "full"
  assert cache.usage() == B


def test_a_folder_that_cannot_be_written_is_a_config_error(tmp_path):
  blocked = tmp_path / "file"
  blocked.write_text("")
  with pytest.raises(ConfigError, match=r"--cache-dir .*file/cache: cannot write there"):
    cache_lib.open_cache(blocked / "cache", 10)
