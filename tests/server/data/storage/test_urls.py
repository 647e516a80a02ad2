"""Bucket URLs and globs, and the storage table: what a config may say."""

from __future__ import annotations

import pytest

from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.storage import settings, urls


@pytest.mark.parametrize("pattern,prefix,matches,misses", [
    ("data/train-*.array_record", "data/", ["data/train-0.array_record"],
     ["data/sub/train-0.array_record", "data/val-0.array_record", "data/train-0.array_recordx"]),
    ("data/**/*.ar", "data/", ["data/a.ar", "data/x/y/b.ar"], ["other/a.ar", "data/a.arr"]),
    ("d/train-0000[0-1]*", "d/", ["d/train-00000-of-3", "d/train-00001"], ["d/train-00002"]),
    ("d/part-?.ar", "d/", ["d/part-1.ar"], ["d/part-10.ar", "d/part-/.ar"]),
    ("exact/name.ar", "exact/", ["exact/name.ar"], ["exact/name.arr"]),
    ("d/[!a]*", "d/", ["d/b1"], ["d/a1"]),
])
def test_a_key_glob_lists_its_literal_folder_and_matches_as_glob_does(pattern, prefix, matches,
                                                                     misses):
  assert urls.glob_prefix(pattern) == prefix
  regex = urls.glob_regex(pattern)
  assert all(regex.match(k) for k in matches), [k for k in matches if not regex.match(k)]
  assert not any(regex.match(k) for k in misses), [k for k in misses if regex.match(k)]


def test_urls_are_told_from_paths():
  assert urls.split("gs://b/x/y.ar") == ("gs", "b", "x/y.ar")
  assert urls.split("s3://b") == ("s3", "b", "")
  assert not urls.is_url("/data/x.ar") and not urls.is_url("http://host/x")
  with pytest.raises(ValueError):
    urls.split("gs:///x")


@pytest.mark.parametrize("table,message", [
    ({"secret_access_key": "x"}, r"unknown storage key\(s\) 'secret_access_key'.*credentials come "
                                 "from the environment"),
    ({"anonymous": "yes"}, "storage key 'anonymous' has the wrong type: str"),
    ({"retry_s": 0}, r"storage key 'retry_s' must be in \(0, 600\], got 0.0"),
    ({"retry_s": True}, "storage key 'retry_s' has the wrong type: bool"),
    ([], r"\[datasets.d.storage\] must be a table"),
    ({"retry_s": 5, "request_timeout_s": 6},
     r"storage key 'request_timeout_s' must be in \(0, retry_s = 5\], got 6"),
])
def test_the_storage_table_refuses_what_it_does_not_know(table, message):
  with pytest.raises(ConfigError, match=f"dataset 'd': {message}"):
    settings.parse("d", table)


def test_the_storage_table_keeps_what_it_is_given():
  got = settings.parse("d", {"endpoint": "http://h:9000", "region": "r", "anonymous": True,
                             "retry_s": 5})
  assert got == settings.StorageSettings("http://h:9000", "r", True, 5.0, 5.0)
  assert settings.parse("d", {}).retry_s == settings.DEFAULT_RETRY_S
