"""OUT_DIR in a bucket (`elevator convert ... s3://bucket/out/`): a staging
with `shards.Staging`'s surface whose folder is local and whose commit
uploads.

The shards are written into a local temporary folder, as for a local
OUT_DIR; once every one is complete, each is uploaded as one object (a PUT,
multipart for a large file), which a bucket shows only once it is whole, so
no reader ever lists a partial shard. The shards go first and the config
(elevator.toml, its paths the shards' URLs) last: a config in the bucket
means its shards are there (with `overwrite`, an earlier config is deleted
before the first upload, and objects of an earlier conversion that this one
did not write after the last). A failed or interrupted run leaves its local
folder removed and, in the bucket, at most some whole shards and no config.

The Beam pipeline (beam.py) uses the same staging on many machines: each
worker writes its shard into a local folder of its own and uploads it
(`upload`); the last step stages the side files and the config and commits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Sequence

from grain_elevator.server.data.storage import objects as objects_lib
from grain_elevator.server.data.storage import settings as settings_lib
from grain_elevator.server.data.storage import urls
from grain_elevator.tools.convert.errors import ConvertError


def _settings(retry_s: float | None) -> settings_lib.StorageSettings:
  """The upload's retry budget (`--upload-retry-s`), checked as a dataset's
  `retry_s` is; endpoint and credentials come from the environment."""
  if retry_s is None:
    return settings_lib.StorageSettings()
  try:
    retry_s, timeout_s = settings_lib.budget(float(retry_s))
  except ValueError as e:
    raise ConvertError(f"--upload-retry-s: {e}") from None
  return settings_lib.StorageSettings(retry_s=retry_s, request_timeout_s=timeout_s)


class BucketStaging:
  """shards.Staging for an OUT_DIR that is a gs://, s3:// or az:// URL."""

  def __init__(self, out_url: str, *, overwrite: bool = False, token: str | None = None,
               retry_s: float | None = None):
    scheme, bucket, key = urls.split(out_url)
    key = key.strip("/")
    self._prefix = key + "/" if key else ""
    self.out_dir = urls.join(scheme, bucket, key)
    self.overwrite = overwrite
    self.token = token or uuid.uuid4().hex[:8]
    self.settings = _settings(retry_s)
    self.tmp_dir = os.path.join(tempfile.gettempdir(), f"elevator-convert-{self.token}.tmp")
    self._store = self._open_store()

  def _open_store(self) -> Any:
    try:
      store, _ = objects_lib.store_of(self.out_dir + "/", self.settings)
    except Exception as e:  # a ConfigError: no obstore, a bad endpoint
      raise ConvertError(f"OUT_DIR {self.out_dir}: {e}") from e
    return store

  def __getstate__(self) -> dict[str, Any]:
    """Without the store (a connection pool): a Beam worker opens its own."""
    return {**self.__dict__, "_store": None}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._store = self._open_store()

  def url(self, name: str) -> str:
    return f"{self.out_dir}/{name}"

  def _existing(self) -> list[str]:
    """What is under OUT_DIR now, as names relative to it."""
    import obstore  # pylint: disable=g-import-not-at-top
    try:
      return sorted(meta["path"][len(self._prefix):]
                    for page in obstore.list(self._store, prefix=self._prefix or None,
                                             chunk_size=1000)
                    for meta in page)
    except Exception as e:  # pylint: disable=broad-except
      raise ConvertError(f"cannot list OUT_DIR {self.out_dir}/: "
                         f"{objects_lib.reason(e)}") from e

  def leftovers(self) -> list[str]:
    return []  # a run's staging folder is local and removed whatever happens

  def check(self, ours: Sequence[str] = ()) -> None:
    """Raises unless OUT_DIR may be written: holding nothing but `ours`
    (what this conversion put), or (overwrite) only what a conversion writes."""
    from grain_elevator.tools.convert import shards as shards_lib  # pylint: disable=g-import-not-at-top
    existing = [n for n in self._existing() if n not in set(ours)]
    shards_lib.check_replaceable(f"{self.out_dir}/", existing, self.overwrite,
                                 where="prefix", things="objects")

  def create(self) -> str:
    os.makedirs(self.tmp_dir)
    return self.tmp_dir

  def upload(self, path: str, name: str) -> None:
    """Puts the local file `path` as the object `name` under OUT_DIR: a
    Beam worker's shard, which the bucket shows only once whole."""
    import obstore  # pylint: disable=g-import-not-at-top
    try:
      with open(path, "rb") as f:
        obstore.put(self._store, self._prefix + name, f)
    except Exception as e:  # pylint: disable=broad-except
      raise ConvertError(f"cannot upload to OUT_DIR {self.out_dir}/ ({name}): "
                         f"{objects_lib.reason(e)}") from e

  def commit(self, uploaded: Sequence[str] = ()) -> None:
    """Uploads the staged shards, then the side files, then the config;
    deletes what an earlier conversion left that this one did not write.
    `uploaded`: objects this conversion put already (Beam's shards, each
    by its own worker). An earlier config is deleted first, so that a
    config in the bucket always names shards that are there."""
    import obstore  # pylint: disable=g-import-not-at-top
    from grain_elevator.tools.convert.shards import CONFIG_FILE  # pylint: disable=g-import-not-at-top
    self.check(ours=uploaded)  # again: something may have appeared meanwhile
    before = set(self._existing())
    names = sorted(os.listdir(self.tmp_dir),
                   key=lambda n: (n == CONFIG_FILE, not n.endswith(".array_record"), n))
    try:
      if CONFIG_FILE in before:
        self.withdraw_config()
      for name in names:
        self.upload(os.path.join(self.tmp_dir, name), name)
      for name in sorted(before - set(names) - set(uploaded)):
        obstore.delete(self._store, self._prefix + name)
    except ConvertError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise ConvertError(f"cannot upload to OUT_DIR {self.out_dir}/: "
                         f"{objects_lib.reason(e)}") from e
    finally:
      shutil.rmtree(self.tmp_dir, ignore_errors=True)

  def withdraw_config(self) -> None:
    """Deletes an earlier conversion's config (if any), before any of its
    shards is replaced: no config ever names a mix of two conversions."""
    import obstore  # pylint: disable=g-import-not-at-top
    from grain_elevator.tools.convert.shards import CONFIG_FILE  # pylint: disable=g-import-not-at-top
    try:
      obstore.delete(self._store, self._prefix + CONFIG_FILE)
    except FileNotFoundError:
      pass
    except Exception as e:  # pylint: disable=broad-except
      raise ConvertError(f"cannot delete {self.url(CONFIG_FILE)}: {objects_lib.reason(e)}") from e

  def read_config(self) -> str:
    """The elevator.toml a commit put, as text."""
    import obstore  # pylint: disable=g-import-not-at-top
    from grain_elevator.tools.convert.shards import CONFIG_FILE  # pylint: disable=g-import-not-at-top
    return bytes(obstore.get(self._store, self._prefix + CONFIG_FILE).bytes()).decode()

  def abort(self) -> None:
    shutil.rmtree(self.tmp_dir, ignore_errors=True)
