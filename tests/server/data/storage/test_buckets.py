"""Shards in buckets, against real protocol servers on 127.0.0.1 (moto's S3,
gcp-storage-emulator) behind a fault-injecting proxy: the stream of a
bucket is the stream of the same shards on local disk (remote and embedded,
H in {1, 2}, 1:1, mixture and stream datasets); a cursor moves between
copies of the same bytes and is refused on other bytes; a replaced object is
refused naming it; faults and an outage cost time, never data; bad
credentials and a missing bucket stop the start with a precise message."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
from typing import Any, Iterator

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from grain_elevator.client import ConfigError, RemoteDataset, StreamMismatchError
from grain_elevator.pipelines import examples
from grain_elevator.proto.errors import DataLossError, ServiceUnavailableError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import registry
from grain_elevator.server.data.object_source import ObjectRecordSource
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server import Server
from grain_elevator.server.data.shards.identity import IDENTITY_TAIL_BYTES
from grain_elevator.tools.testing import storage_servers
from grain_elevator.tools.testing.launcher import ELEVATOR
import datasets
from helpers import assert_trees_equal, server_with_env

pytestmark = pytest.mark.slow  # S3 and GCS emulators

G = 8
STEPS = 4
BIG = {"height": 32, "width": 32, "channels": 3}
# Every GET answered 503 for this long: past the longest wait between
# retries (2 s), well within a read's retry budget (DEFAULT_RETRY_S).
OUTAGE_S = 4.0


def _write_config(folder: pathlib.Path, name: str, where: str,
                  storage: dict[str, float] | None = None, only_img: bool = False) -> str:
  """The datasets over the shards at `where` (a folder or a bucket's URL):
  img, 1:1, shuffled, 2 epochs (with `storage` settings); a mixture of two,
  mix; a stream, few (a filter and a batch_fn). `only_img`: img alone, for
  a server that serves nothing else (each dataset a worker opens costs
  requests to storage as it starts)."""
  shards = f"{where}/*.array_record"
  img = datasets.images(shards, image=BIG, seed=5, num_epochs=2, storage=storage)
  if only_img:
    return datasets.write_config(folder / name, img=img)
  return datasets.write_config(
      folder / name, img=img,
      a=datasets.images(f"{where}/train-00000*", image=BIG, seed=1),
      b=datasets.images(f"{where}/train-0000[1-2]*", image=BIG, seed=2),
      mix=datasets.mixture(a=0.6, b=0.4),
      few=datasets.images(shards, image=BIG, pipeline=datasets.DECODE_SOME,
                          batch_fn="grain_elevator.pipelines.examples:batch_centered", seed=21,
                          num_epochs=2, options={"labels": [1, 3, 7]}))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> pathlib.Path:
  """240 records of 32x32x3 images in 3 shards of ~250 KB (bigger than
  the tail a reader keeps from its open, IDENTITY_TAIL_BYTES), and a copy
  with other bytes in shard 1 (other/)."""
  root = tmp_path_factory.mktemp("bucket-data")
  examples.write_image_shards(str(root / "shards"), num_records=240, num_shards=3,
                              height=32, width=32, channels=3)
  examples.write_image_shards(str(root / "other"), num_records=240, num_shards=3,
                              height=32, width=32, channels=3, seed=1)
  for s in (0, 2):  # other/ differs from shards/ in shard 1 alone
    name = f"train-0000{s}-of-00003.array_record"
    (root / "other" / name).write_bytes((root / "shards" / name).read_bytes())
  return root


@pytest.fixture(scope="module")
def local_config(shards: pathlib.Path) -> str:
  return _write_config(shards, "local.toml", str(shards / "shards"))


@pytest.fixture(scope="module")
def uploaded(bucket, shards: pathlib.Path) -> dict[str, str]:
  """The shards in the bucket (data/), the other bytes (other/), a copy for
  the replacement test (replace/); their configs, and img alone over data/
  (faults) and over replace/ (the tests that read only img)."""
  for prefix in ("data", "other", "replace"):
    bucket.upload(shards / ("other" if prefix == "other" else "shards"), prefix)
  out = {prefix: _write_config(shards, f"{bucket.kind}-{prefix}.toml", bucket.url(prefix))
         for prefix in ("data", "other")}
  out["faults"] = _write_config(shards, f"{bucket.kind}-faults.toml", bucket.url("data"),
                                only_img=True)
  out["replace"] = _write_config(shards, f"{bucket.kind}-replace.toml", bucket.url("replace"),
                                 only_img=True)
  return out


def _server(config: str, bucket, **options: Any):
  return server_with_env(config, bucket.env(), **options)


@pytest.fixture(scope="module")
def bucket_server(bucket, uploaded) -> Iterator[Server]:
  with _server(uploaded["data"], bucket, workers=2) as server:
    yield server


@pytest.fixture(scope="module")
def fault_server(bucket, uploaded) -> Iterator[Server]:
  """A server whose every read goes to storage (no read-ahead, which may
  hold an earlier test's chunks for read_ahead.STALE_S): the fault tests'
  reads meet their faults. It serves img alone, all they read."""
  with _server(uploaded["faults"], bucket, workers=1, read_ahead_mb=0) as server:
    yield server


@pytest.fixture
def bucket_env(bucket, monkeypatch) -> None:
  """This process reads the bucket too (embedded mode)."""
  for k, v in bucket.env().items():
    monkeypatch.setenv(k, v)


def _steps(ds: RemoteDataset, n: int, first: int = 0) -> list[Any]:
  with ds:
    it = iter(ds)
    if first:
      it.set_state({**it.get_state(), "step": first})
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("name", ["img", "mix", "few"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_bucket_serves_the_stream_of_its_local_copy(bucket, bucket_server, bucket_env,
                                                      uploaded, local_config, name, n):
  for h in range(n):
    want = _steps(RemoteDataset.embedded(local_config, name, G, shard_index=h,
                                                shard_count=n), STEPS)
    for ds in (RemoteDataset(bucket_server.target, name, G, shard_index=h, shard_count=n),
               RemoteDataset.embedded(uploaded["data"], name, G, shard_index=h, shard_count=n)):
      got = _steps(ds, STEPS)
      for step, (a, b) in enumerate(zip(got, want)):
        assert_trees_equal(a, b, f"{bucket.kind} {ds.targets[0][:8]} host {h}/{n} step {step}")
  assert bucket.proxy.stats.ranged_gets > 0


def test_the_fingerprint_is_the_bytes_not_where_they_sit(bucket, bucket_env, uploaded,
                                                         local_config):
  """Local disk and bucket: one fingerprint; other bytes in one shard: another."""
  def fingerprints(path: str) -> dict[str, str]:
    opened = registry.Datasets(config_lib.load_config(path), open_now=False)
    return {n: opened.get(n).info.config_fingerprint for n in ("img", "few", "mix")}
  local, remote, other = (fingerprints(p) for p in (local_config, uploaded["data"],
                                                    uploaded["other"]))
  assert local == remote
  assert all(other[n] != local[n] for n in local)


@pytest.mark.parametrize("name", ["img", "few"])
def test_a_cursor_moves_from_local_disk_to_a_bucket(bucket, bucket_server, bucket_env, uploaded,
                                                    local_config, name):
  with RemoteDataset.embedded(local_config, name, G) as ds:
    it = iter(ds)
    for _ in range(3):
      next(it)
    saved = it.get_state()
    want = [next(it) for _ in range(2)]
  for ds in (RemoteDataset(bucket_server.target, name, G),
             RemoteDataset.embedded(uploaded["data"], name, G)):
    with ds:
      it = iter(ds)
      it.set_state(saved)
      for step, w in enumerate(want):
        assert_trees_equal(next(it), w, f"{ds.targets[0][:8]} step {3 + step}")
  # Other bytes under the same names and dataset: refused, never served.
  with RemoteDataset.embedded(uploaded["other"], name, G) as ds:
    it = iter(ds)
    with pytest.raises(StreamMismatchError):
      it.set_state(saved)
      next(it)


def test_a_replaced_object_is_refused_naming_it(bucket, bucket_env, uploaded, shards,
                                                local_config):
  """Steps asked after the replacement (none asked before, so none in the
  server's batch cache): each one that needs the replaced shard is refused
  naming it, the others are exact (the local copy's: the bytes the server
  started with); none holds a mix."""
  (want,) = _steps(RemoteDataset.embedded(uploaded["replace"], "img", G), 1, first=20)
  local = _steps(RemoteDataset.embedded(local_config, "img", G), 8, first=40)
  replaced = bucket.url("replace/train-00001-of-00003.array_record")
  with _server(uploaded["replace"], bucket, workers=1) as server:
    assert_trees_equal(_steps(RemoteDataset(server.target, "img", G, prefetch=0), 1,
                              first=20)[0], want)
    bucket.put("replace/train-00001-of-00003.array_record",
               (shards / "other" / "train-00001-of-00003.array_record").read_bytes())
    refused = 0
    for step in range(40, 48):
      try:
        got = _steps(RemoteDataset(server.target, "img", G, prefetch=0), 1, first=step)[0]
      except StreamMismatchError as e:
        assert f"shard {replaced} changed since the server started" in str(e), e
        refused += 1
      else:
        assert_trees_equal(got, local[step - 40], f"step {step}")
    assert refused >= 1  # most steps read a record of that shard outside its tail
    assert len(server.worker_pids()) == 1  # the worker serves on
  assert not server.worker_pids()  # a clean stop


@pytest.mark.parametrize("faults", [("503", "429", "reset", "truncate", "stall"),
                                    ("503",) * 6 + ("reset",) * 6])
def test_transient_faults_cost_time_not_data(bucket, fault_server, local_config, faults):
  g = 16  # steps no earlier test asked for: not in the server's batch cache
  bucket.proxy.stall_s = 1.0
  bucket.proxy.faults_only_for = lambda method, path: method == "GET"
  before = bucket.proxy.stats.faults
  bucket.proxy.inject(*faults)
  first = 1 + 3 * (len(faults) % 2)  # each case its own steps
  want = _steps(RemoteDataset.embedded(local_config, "img", g), 3, first=first)
  got = _steps(RemoteDataset(fault_server.target, "img", g, prefetch=0), 3, first=first)
  for step, (a, b) in enumerate(zip(got, want)):
    assert_trees_equal(a, b, f"step {first + step}")
  assert bucket.proxy.pending_faults() == 0
  assert bucket.proxy.stats.faults - before == len(faults)


def test_an_outage_costs_time_not_data(bucket, fault_server, local_config):
  g = 24
  want = _steps(RemoteDataset.embedded(local_config, "img", g), 2, first=2)
  bucket.proxy.faults_only_for = lambda method, path: method == "GET"
  before = bucket.proxy.stats.faults
  bucket.proxy.outage(OUTAGE_S, "503")
  got = _steps(RemoteDataset(fault_server.target, "img", g, prefetch=0), 2, first=2)
  for step, (a, b) in enumerate(zip(got, want)):
    assert_trees_equal(a, b, f"step {2 + step}")
  assert bucket.proxy.stats.faults - before > 0


def test_past_the_retry_budget_a_read_is_unavailable_naming_the_object(
    bucket, bucket_env, uploaded, shards, local_config):
  path = _write_config(shards, f"{bucket.kind}-budget.toml", bucket.url("data"),
                       storage={"retry_s": 1})
  img = registry.Datasets(config_lib.load_config(path), open_now=False).get("img")
  bucket.proxy.faults_only_for = lambda method, path: method == "GET"
  bucket.proxy.outage(60.0, "503")
  with pytest.raises(ServiceUnavailableError, match=rf"object {bucket.url('data/')}\S+: storage "
                     r"did not answer .* retry budget of 1s"):
    img.host_batch_leaves(7, G, 0, 1)
  bucket.proxy.clear()
  # Storage answers again: the step is exact (read with the default budget:
  # one second is too short for a loaded machine's emulator).
  img = registry.Datasets(config_lib.load_config(uploaded["data"]), open_now=False).get("img")
  want = registry.Datasets(config_lib.load_config(local_config), open_now=False).get("img")
  for a, b in zip(img.host_batch_leaves(7, G, 0, 1), want.host_batch_leaves(7, G, 0, 1)):
    assert a.tobytes() == b.tobytes()


def test_a_missing_bucket_or_object_stops_the_start(bucket, bucket_env, shards):
  path = _write_config(shards, f"{bucket.kind}-missing.toml",
                       f"{bucket.scheme}://no-such-bucket/data")
  with pytest.raises(ConfigError, match=rf"dataset 'img': cannot list {bucket.scheme}://"
                     r"no-such-bucket/data/: the bucket or object does not exist"):
    config_lib.load_config(path)
  path = _write_config(shards, f"{bucket.kind}-empty.toml", bucket.url("nothing-here"))
  with pytest.raises(ConfigError, match=rf"dataset 'img': key 'paths': "
                     rf"{bucket.url('nothing-here')}/\*.array_record matches no objects"):
    config_lib.load_config(path)


@pytest.fixture(scope="module")
def s3_checking_keys():
  try:
    server = storage_servers.S3Server(checks_keys=True)
  except storage_servers.ServerUnavailable as e:
    pytest.skip(f"moto cannot run here ({e})")
  yield server
  server.stop()


def test_a_wrong_key_stops_the_start_without_showing_it(s3_checking_keys, shards):
  secret = "wrong-secret-do-not-print-42"
  path = _write_config(shards, "wrong-key.toml", "s3://some-bucket/data")
  env = {**os.environ, **s3_checking_keys.env(), "AWS_SECRET_ACCESS_KEY": secret}
  result = subprocess.run([*ELEVATOR, "serve", "--config", path, "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
  assert result.returncode == 2, result.stderr
  assert ("dataset 'img': cannot list s3://some-bucket/data/: access denied: check the "
          "credentials") in result.stderr
  assert "HTTP 403" in result.stderr
  assert secret not in result.stderr + result.stdout
  assert s3_checking_keys.ACCESS_KEY not in result.stderr + result.stdout


def test_one_record_costs_one_ranged_read_of_its_chunk(bucket, bucket_env, uploaded, shards):
  urls = [bucket.url(f"data/train-0000{s}-of-00003.array_record") for s in range(3)]
  source = ObjectRecordSource(urls)
  reader = source._readers[0]  # pylint: disable=protected-access
  begin, end = reader.extent(0)
  assert end < reader.obj.size - IDENTITY_TAIL_BYTES
  local = BatchedArrayRecordSource(
      sorted(str(p) for p in (shards / "shards").glob("*.array_record")))
  before = dataclasses.replace(bucket.proxy.stats)
  assert source[0] == local[0]
  after = bucket.proxy.stats
  assert after.ranged_gets - before.ranged_gets == 1
  assert after.body_bytes - before.body_bytes == end - begin


def test_an_empty_shard_reads_as_its_local_copy(bucket, bucket_env, shards, tmp_path):
  """A shard with no records (a converter's last shard can be one) is read
  from a bucket as from disk: no records, the others' keys unmoved."""
  writer = ArrayRecordWriter(str(tmp_path / "empty.array_record"), "group_size:1")
  writer.close()
  local = [str(tmp_path / "empty.array_record"),
           str(shards / "shards" / "train-00000-of-00003.array_record")]
  for i, path in enumerate(local):
    bucket.put(f"with-empty/{i}.array_record", pathlib.Path(path).read_bytes())
  source = ObjectRecordSource([bucket.url(f"with-empty/{i}.array_record") for i in range(2)])
  expected = BatchedArrayRecordSource(local)
  assert len(source) == len(expected) == 80
  assert source.read_raw([79, 0, 40]) == list(expected._getitems([79, 0, 40]))  # pylint: disable=protected-access


def test_a_corrupt_object_is_data_loss_naming_it_and_the_byte(bucket, bucket_env, shards):
  data = bytearray((shards / "shards" / "train-00000-of-00003.array_record").read_bytes())
  data[5000] ^= 0xFF  # inside an early chunk, far from the tail the identity hashes
  bucket.put("corrupt/train-00000-of-00003.array_record", bytes(data))
  url = bucket.url("corrupt/train-00000-of-00003.array_record")
  source = ObjectRecordSource([url])
  with pytest.raises(DataLossError, match=rf"shard {url} is corrupt: {url}: chunk at byte \d+: "
                     "(data|header) hash mismatch"):
    source.read_raw(list(range(80)))


def test_a_local_copy_with_other_names_and_times_fingerprints_the_same(shards, local_config,
                                                                      tmp_path):
  """The fingerprint is the bytes in order: a copy under other names (in the
  same order), with other mtimes, resumes the same cursors."""
  copy = tmp_path / "copy"
  copy.mkdir()
  for i, f in enumerate(sorted((shards / "shards").glob("*.array_record"))):
    target = copy / f"train-0000{i}-copied.array_record"
    target.write_bytes(f.read_bytes())
    os.utime(target, (1_000_000_000 + i, 1_000_000_000 + i))
  path = _write_config(tmp_path, "copy.toml", str(copy))

  def fingerprint(p: str) -> str:
    return registry.Datasets(config_lib.load_config(p), open_now=False).get(
        "img").info.config_fingerprint
  assert fingerprint(path) == fingerprint(local_config)


def test_a_stalled_read_is_cut_at_the_request_timeout_and_retried(bucket, bucket_env, uploaded,
                                                                  shards, local_config):
  """Two reads get no answer at all; each is cut after request_timeout_s and
  retried, within a retry_s that one wait of the default (retry_s itself,
  here) would use up."""
  path = _write_config(shards, f"{bucket.kind}-stall.toml", bucket.url("data"),
                       storage={"retry_s": 10, "request_timeout_s": 1})
  img = registry.Datasets(config_lib.load_config(path), open_now=False).get("img")
  bucket.proxy.stall_s = 600.0  # no answer, ever
  bucket.proxy.faults_only_for = lambda method, path: method == "GET"
  bucket.proxy.inject("stall", "stall")
  got = img.host_batch_leaves(9, G, 0, 1)
  assert bucket.proxy.pending_faults() == 0
  want = registry.Datasets(config_lib.load_config(local_config), open_now=False).get("img")
  for a, b in zip(got, want.host_batch_leaves(9, G, 0, 1)):
    assert a.tobytes() == b.tobytes()
