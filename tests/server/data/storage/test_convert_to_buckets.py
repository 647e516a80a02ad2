"""`elevator convert ... s3://bucket/out/`, against moto behind the fault
proxy: the shards uploaded are the bytes a local conversion writes, its
config names them by URL, and the server reads the local copy's records
from them exactly; an OUT_DIR in use is refused without --overwrite and
replaced with it; a failed upload leaves no config in the bucket."""

from __future__ import annotations

import json
import pathlib
import subprocess
import pytest

from grain_elevator.server.data.object_source import ObjectRecordSource
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.tools.launcher import ELEVATOR
from helpers import shard_bytes


@pytest.fixture
def bucket_env(bucket, monkeypatch) -> dict[str, str]:
  if bucket.kind == "gcs":
    pytest.skip("obstore's GCS client asks the metadata server for an OAuth token to write, "
                "even with skip_signature, and the emulator has no token endpoint: "
                "conversions to gs:// are not tested here")
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


@pytest.mark.slow  # the upload retries for the default retry budget first
def test_a_failed_upload_leaves_no_config(bucket, bucket_env, jsonl):
  prefix = f"failed-{bucket.kind}"
  # Every PUT fails: the upload gives up within the retry budget.
  bucket.proxy.faults_only_for = lambda method, path: method in ("PUT", "POST")
  bucket.proxy.outage(600)
  result = _convert(jsonl, bucket.url(prefix), bucket_env)
  bucket.proxy.clear()
  assert result.returncode == 2
  assert f"cannot upload to OUT_DIR {bucket.url(prefix)}/" in result.stderr
  assert "elevator.toml" not in _objects(bucket, prefix)
