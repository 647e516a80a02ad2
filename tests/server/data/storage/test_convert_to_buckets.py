"""`elevator convert ... s3://bucket/out/` and `gs://bucket/out/`, and the
Beam pipeline to the same, against moto and gcp-storage-emulator behind the
fault proxy: the shards uploaded are the bytes a local conversion writes,
its config names them by URL, and the server reads the local copy's records
from them exactly; an OUT_DIR in use is refused without --overwrite and
replaced with it; a failed upload leaves no config in the bucket."""

from __future__ import annotations

import json
import pathlib
import subprocess
import numpy as np
import pytest

from grain_elevator.server.data.object_source import ObjectRecordSource
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import run_beam, shard_bytes

pytestmark = pytest.mark.slow  # S3 and GCS emulators


@pytest.fixture
def bucket_env(bucket, monkeypatch) -> dict[str, str]:
  env = bucket.env()
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  return env


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> pathlib.Path:
  folder = tmp_path_factory.mktemp("jsonl-in")
  for f in range(2):
    (folder / f"part-{f}.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {f}-{i} " * (i % 7 + 1), "n": i}) + "\n"
                for i in range(40)))
  return folder


def _convert(jsonl: pathlib.Path, out: str, env: dict[str, str], *extra: str
             ) -> subprocess.CompletedProcess:
  return subprocess.run([*ELEVATOR, "convert", "jsonl", str(jsonl / "*.jsonl"), out,
                         "--shards", "3", "--workers", "1", "--quiet", *extra],
                        capture_output=True, text=True, timeout=120, env={**_os_env(), **env})


def _os_env() -> dict[str, str]:
  import os  # pylint: disable=g-import-not-at-top
  return dict(os.environ)


def _objects(bucket, prefix: str) -> dict[str, bytes]:
  import obstore  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data.storage import objects  # pylint: disable=g-import-not-at-top
  store, _ = objects.store_of(bucket.url(prefix + "/"))
  out = {}
  for page in obstore.list(store, prefix=prefix + "/"):
    for meta in page:
      out[meta["path"][len(prefix) + 1:]] = bytes(obstore.get(store, meta["path"]).bytes())
  return out


def test_a_conversion_to_a_bucket_serves_the_local_conversion_exactly(
    bucket, bucket_env, jsonl, tmp_path):
  local = tmp_path / "local"
  assert _convert(jsonl, str(local), bucket_env).returncode == 0
  prefix = f"converted-{bucket.kind}"
  result = _convert(jsonl, bucket.url(prefix) + "/", bucket_env)
  assert result.returncode == 0, result.stderr
  assert bucket.url(f"{prefix}/train-*-of-00003.array_record") in result.stdout
  got = _objects(bucket, prefix)
  want = {n: b for n, b in shard_bytes(local).items() if n.endswith(".array_record")}
  assert {n: b for n, b in got.items() if n.endswith(".array_record")} == want
  config = got["elevator.toml"].decode()
  assert f'"{bucket.url(prefix)}/train-*-of-00003.array_record"' in config
  # What the server reads from the bucket is the local conversion's records.
  names = sorted(want)
  remote = ObjectRecordSource([f"{bucket.url(prefix)}/{n}" for n in names])
  local_records = BatchedArrayRecordSource([str(local / n) for n in names])
  assert len(remote) == len(local_records) == 80
  assert list(remote.read_raw(range(80))) == [local_records[i] for i in range(80)]


def test_an_out_prefix_in_use_is_refused_then_replaced_with_overwrite(bucket, bucket_env,
                                                                      jsonl):
  out = bucket.url(f"reused-{bucket.kind}")
  assert _convert(jsonl, out, bucket_env).returncode == 0
  again = _convert(jsonl, out, bucket_env)
  assert again.returncode == 2
  assert f"OUT_DIR {out}/ already holds 3 shard(s)" in again.stderr
  assert "--overwrite" in again.stderr
  replaced = _convert(jsonl, out, bucket_env, "--overwrite", "--shards", "2")
  assert replaced.returncode == 0, replaced.stderr
  names = sorted(_objects(bucket, f"reused-{bucket.kind}"))
  assert names == ["elevator.toml", "train-00000-of-00002.array_record",
                   "train-00001-of-00002.array_record"]


def test_a_failed_upload_leaves_no_config(bucket, bucket_env, jsonl):
  prefix = f"failed-{bucket.kind}"
  # Every PUT fails: the upload gives up once its retry budget is spent.
  bucket.proxy.faults_only_for = lambda method, path: method in ("PUT", "POST")
  bucket.proxy.outage(600)
  result = _convert(jsonl, bucket.url(prefix), bucket_env, "--upload-retry-s", "2")
  bucket.proxy.clear()
  assert result.returncode == 2
  assert f"cannot upload to OUT_DIR {bucket.url(prefix)}/" in result.stderr
  assert "elevator.toml" not in _objects(bucket, prefix)


@pytest.mark.parametrize("value", ["0", "601", "-1"])
def test_an_upload_retry_budget_out_of_range_is_refused_before_any_work(jsonl, tmp_path,
                                                                       value):
  result = _convert(jsonl, "s3://no-such-bucket/out", {"TMPDIR": str(tmp_path)},
                    "--upload-retry-s", value)
  assert result.returncode == 2
  assert "elevator: error: --upload-retry-s: 'retry_s' must be in (0, 600]" in result.stderr
  assert not list(tmp_path.iterdir())  # no staging folder was made


def test_the_beam_pipeline_writes_to_a_bucket_what_it_writes_locally(bucket, bucket_env,
                                                                     tmp_path):
  """Each Beam worker uploads its own shard (no shared file system); the
  last step puts the config; --overwrite replaces an earlier conversion."""
  for i, n in enumerate((30, 21)):
    np.savez(tmp_path / f"p{i}.npz", x=np.arange(n * 4, dtype=np.float32).reshape(n, 4) + i,
             y=np.arange(n, dtype=np.int64))
  (tmp_path / "beam-tmp").mkdir()
  env = {**bucket_env, "TMPDIR": str(tmp_path / "beam-tmp")}  # DirectRunner's leftovers
  inputs = str(tmp_path / "*.npz")
  local = run_beam("npz", inputs, str(tmp_path / "local"), "--shards", "3", env=env)
  assert local.returncode == 0, local.stderr[-3000:]
  prefix = f"beam-{bucket.kind}"
  done = run_beam("npz", inputs, bucket.url(prefix) + "/", "--shards", "3", env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  got = _objects(bucket, prefix)
  want = shard_bytes(tmp_path / "local")
  assert {n: b for n, b in got.items() if n.endswith(".array_record")} == {
      n: b for n, b in want.items() if n.endswith(".array_record")}
  assert f'"{bucket.url(prefix)}/train-*-of-00003.array_record"' in got["elevator.toml"].decode()
  assert done.stdout == got["elevator.toml"].decode()
  again = run_beam("npz", inputs, bucket.url(prefix), "--shards", "2", env=env)
  assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr[-3000:]
  replaced = run_beam("npz", inputs, bucket.url(prefix), "--shards", "2", "--overwrite", env=env)
  assert replaced.returncode == 0, replaced.stderr[-3000:]
  assert sorted(_objects(bucket, prefix)) == [
      "elevator.toml", "train-00000-of-00002.array_record", "train-00001-of-00002.array_record"]
  assert not list((tmp_path / "beam-tmp").glob("elevator-*"))
