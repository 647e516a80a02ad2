"""The operator's dataset registry: a TOML file read with `tomllib`.

```toml
[datasets.NAME]
paths = ["shards/train-*.array_record"]  # globs, relative to this file's folder,
                                         # or in a bucket: "gs://b/train-*.array_record",
                                         # "s3://b/..." (docs/buckets.md)
# or, in place of `paths`, a prepared TFDS dataset (server/data/tfds_source.py):
# tfds = "mnist:3.0.1"   split = "train[:90%]"   data_dir = "tfds_data"
pipeline = "package.module:function"     # optional: MapDataset -> MapDataset
batch_transform = "package.module:fn"    # optional, the same on a whole batch
seed = 42
shuffle = true
num_epochs = 1                           # 0 = repeat forever
drop_remainder = true                    # false: evaluation mode, every record
                                         # once, the last batch padded + "_mask"
[datasets.NAME.options]                  # keyword arguments for `pipeline`
[datasets.NAME.storage]                  # optional, for bucket paths: endpoint, region,
                                         # anonymous, retry_s, request_timeout_s
                                         # (server/data/storage/settings.py)
```

A dataset may instead mix other registered datasets (server/data/mixture.py):

```toml
[datasets.mix]
mixture = { a = 0.7, b = 0.3 }           # weights, normalised
# or, in place of `mixture`, weights that change at global steps:
[[datasets.mix.schedule]]
step = 0
weights = { a = 0.7, b = 0.3 }
[[datasets.mix.schedule]]
step = 50
weights = { a = 0.2, b = 0.8 }
```

A stream dataset (server/data/streams/stream.py) is one whose `pipeline`
filters or flat-maps, or that names what runs after it:

```toml
[datasets.lm]
paths = ["text/*.array_record"]          # or tfds = ..., or source = "mix":
                                         # a registered mixture of fixed weights
pipeline = "lm.pipes:tokenize"           # MapDataset -> MapDataset (holes allowed)
iter_pipeline = "lm.pipes:pack"          # IterDataset -> IterDataset, optional
batch_fn = "lm.pipes:collate"            # Grain's batch_fn, optional
stream_shards = 4                        # optional: sub-streams made apart (default 1)
[datasets.lm.iter_options]               # keyword arguments for `iter_pipeline`
```

Clients only name a dataset; paths and code come from this file alone.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import itertools
import logging
import os
import pathlib
import tomllib
from typing import TYPE_CHECKING, Any, Callable

from grain_elevator.proto import limits
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data.storage import settings as storage_settings
from grain_elevator.server.data.storage import urls
from grain_elevator.server.data.storage.settings import StorageSettings

if TYPE_CHECKING:
  from grain_elevator.server.data.tfds_source import TfdsSplit

# Grain's import-time warning where JAX is not installed (grain/_src/core/profiler.py).
_NO_JAX_PROFILER = "Failed to load jax profiler: %s"


def _jax_is_installed_or_other(record: logging.LogRecord) -> bool:
  """A logging filter: False for Grain's "Failed to load jax profiler: No
  module named 'jax'" alone. A JAX that is installed but fails to import
  (a missing jaxlib, say) still warns."""
  if record.msg != _NO_JAX_PROFILER or not isinstance(record.args, tuple) or not record.args:
    return True
  error = record.args[0]
  return not (isinstance(error, ModuleNotFoundError) and error.name == "jax")


def _quiet_grain_without_jax() -> None:
  """The server never profiles with JAX, and its image has none
  (deploy/Dockerfile), yet every server process (the supervisor, the fork
  server) logged Grain's warning that JAX's profiler is missing at start.
  Installed when this module is imported: every server process imports it
  before Grain (tests/server/test_startup_errors.py pins that)."""
  try:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  except ImportError:  # no absl, no Grain: nothing logs it
    return
  absl_logging.get_absl_logger().addFilter(_jax_is_installed_or_other)


_quiet_grain_without_jax()

_KEYS = {"paths", "tfds", "split", "data_dir", "source", "pipeline", "batch_transform",
         "iter_pipeline", "batch_fn", "seed", "shuffle", "num_epochs", "drop_remainder",
         "options", "iter_options", "mixture", "schedule", "storage", "stream_shards"}
# What a dataset reads: exactly one of these.
_SOURCE_KEYS = ("paths", "tfds", "source")
_TFDS_KEYS = {"split", "data_dir"}
_MIXTURE_KEYS = {"mixture", "schedule"}
_TOP_KEYS = {"datasets"}


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """One `[datasets.NAME]` table, validated, with its globs expanded."""

  name: str
  files: tuple[str, ...]  # sorted absolute paths, or object URLs (gs://, s3://, az://)
  pipeline: str | None = None
  # fn(raw_records: list[bytes], **options) -> the stacked batch; must equal
  # the per-record pipeline's rows stacked (checked at start-up).
  batch_transform: str | None = None
  seed: int = 0
  shuffle: bool = True
  num_epochs: int = 1  # 0 = forever
  # False: evaluation mode, the final partial batch padded (proto/contract.py).
  drop_remainder: bool = True
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  tfds: TfdsSplit | None = None  # a TFDS split in place of `paths`
  # A mixture in place of a source: (first global step, ((component, weight), ...))
  # per segment, steps increasing from 0, weights normalised (server/data/mixture.py).
  schedule: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] | None = None
  # A stream dataset's keys (server/data/streams/stream.py): the registered
  # mixture of fixed weights whose records it reads (in place of files), what
  # runs after `pipeline` on its IterDataset, and the batch function.
  source: str | None = None
  iter_pipeline: str | None = None
  batch_fn: str | None = None
  iter_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Sub-streams (server/data/streams/sub_streams.py): N > 1 splits the
  # stream into N made apart, each over every N-th record, G/N rows a step.
  stream_shards: int = 1
  # The config file's folder: where relative paths in options are taken from
  # (grain_elevator.pipelines.config_path).
  base_dir: str = ""
  # How its bucket paths are reached (`[datasets.NAME.storage]`); None: the
  # environment's defaults.
  storage: StorageSettings | None = None

  @property
  def names_a_stream(self) -> bool:
    """Whether the config alone makes it a stream dataset (a pipeline that
    filters or flat-maps makes it one too, found when it is opened)."""
    return bool(self.iter_pipeline or self.batch_fn or self.source or self.stream_shards > 1)

  def option_paths(self) -> list[tuple[str, str]]:
    """(where, absolute path) for every string in `options` and
    `iter_options`, at any depth, resolved as a pipeline resolves it
    (`pipelines.config_path`); `where` names it: "options.tokenizer",
    "iter_options.vocab[1]". Those that name an existing regular file are
    part of the dataset's identity (server/data/shards/option_files.py)."""
    from grain_elevator import pipelines  # pylint: disable=g-import-not-at-top
    out: list[tuple[str, str]] = []
    todo: list[tuple[str, Any]] = [("options", self.options),
                                   ("iter_options", self.iter_options)]
    with pipelines.building_from(self.base_dir):
      while todo:
        where, value = todo.pop()
        if isinstance(value, str):
          out.append((where, pipelines.config_path(value)))
        elif isinstance(value, dict):
          todo.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
          todo.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return sorted(out)

  def pipeline_fn(self) -> Callable[..., Any] | None:
    return None if self.pipeline is None else import_function(
        self.name, "pipeline", self.pipeline)

  def batch_transform_fn(self) -> Callable[..., Any] | None:
    return None if self.batch_transform is None else import_function(
        self.name, "batch_transform", self.batch_transform)

  def iter_pipeline_fn(self) -> Callable[..., Any] | None:
    return None if self.iter_pipeline is None else import_function(
        self.name, "iter_pipeline", self.iter_pipeline)

  def batch_fn_fn(self) -> Callable[..., Any] | None:
    return None if self.batch_fn is None else import_function(
        self.name, "batch_fn", self.batch_fn)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  path: str
  datasets: dict[str, DatasetConfig]


def import_function(dataset: str, key: str, spec: str) -> Callable[..., Any]:
  """Resolves "package.module:function"; errors name the dataset and key."""
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise ConfigError(
        f"dataset {dataset!r}: key {key!r} must look like "
        f"'package.module:function', got {spec!r}"
    )
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # ImportError, or anything the module raises.
    raise ConfigError(
        f"dataset {dataset!r}: key {key!r}: cannot import module "
        f"{module_name!r}: {type(e).__name__}: {e}"
    ) from e
  fn = module
  for part in attr.split("."):
    fn = getattr(fn, part, None)
    if fn is None:
      raise ConfigError(
          f"dataset {dataset!r}: key {key!r}: module {module_name!r} has "
          f"no attribute {attr!r}"
      )
  if not callable(fn):
    raise ConfigError(f"dataset {dataset!r}: key {key!r}: {spec!r} is not callable")
  return fn


def _expect(dataset: str, key: str, value: Any, cls: type, what: str) -> None:
  # bool is an int subclass; never accept it where a number is wanted.
  if not isinstance(value, cls) or (cls is not bool and isinstance(value, bool)):
    raise ConfigError(
        f"dataset {dataset!r}: key {key!r} must be {what}, got {value!r}"
    )


def unreadable(what: str, path: str, more: str = "") -> ConfigError:
  """The one-line error for data this process's user may not read: a
  container's user (uid 10001 in deploy/Dockerfile) is not the owner of a
  folder made on the host (`mktemp -d` is mode 0700), and a traceback of
  PermissionError says neither whose access failed nor what to do."""
  uid, gid = os.geteuid(), os.getegid()
  return ConfigError(
      f"{what} {path!r}{more} cannot be read by uid {uid} (gid {gid}): permission denied; "
      f"make it and its folders readable by that user (chmod o+rX, or chown {uid}:{gid}), "
      "or run as a user that can read them (docker run --user UID:GID)")


def _may(path: str, mode: int) -> bool:
  """Whether this process may access `path` in `mode`, as its effective
  user (a set-uid start or `setpriv` may differ from the real one)."""
  return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _blocked_folder(pattern: str) -> str | None:
  """The first folder on the way to `pattern`'s files that exists but that
  this process may not enter (or, the one its wildcards are matched in, may
  not list); None where the pattern truly matches nothing."""
  parts = pathlib.PurePath(pattern).parts
  literal = list(itertools.takewhile(lambda part: glob.escape(part) == part, parts))
  wild = len(literal) < len(parts)
  folder = pathlib.PurePath(*literal[:len(parts) - 1])
  for above in [*reversed(folder.parents), folder]:
    if not os.path.isdir(above):
      return None
    listed = wild and above == folder
    if not _may(str(above), os.X_OK | (os.R_OK if listed else 0)):
      return str(above)
  return None


def _expand_paths(name: str, table: dict[str, Any], base_dir: pathlib.Path,
                  storage: StorageSettings | None) -> set[str]:
  if "paths" not in table:
    raise ConfigError(f"dataset {name!r}: key 'paths' (or 'tfds', or 'source') is required")
  given = sorted(_TFDS_KEYS & set(table))
  if given:
    raise ConfigError(
        f"dataset {name!r}: key(s) {', '.join(map(repr, given))} belong to a "
        "'tfds' dataset; with 'paths' they mean nothing")
  paths = table["paths"]
  if isinstance(paths, str):
    paths = [paths]
  _expect(name, "paths", paths, list, "a list of glob strings")
  files: set[str] = set()
  for pattern in paths:
    _expect(name, "paths", pattern, str, "a list of glob strings")
    if "://" in pattern:
      if not urls.is_url(pattern):
        raise ConfigError(f"dataset {name!r}: key 'paths': {pattern!r}: only gs://, s3:// and "
                          "az:// URLs (with a bucket) are read; other paths are local files")
      from grain_elevator.server.data.storage import objects  # pylint: disable=g-import-not-at-top
      files.update(objects.objects().expand(name, pattern, storage or StorageSettings()))
      continue
    full = os.path.join(base_dir, os.path.expanduser(pattern))
    matched = [p for p in glob.glob(full, recursive=True) if os.path.isfile(p)]
    if not matched:
      # glob says nothing of a folder it may not list: name it, not "no files".
      blocked = _blocked_folder(full)
      if blocked is not None:
        raise unreadable(f"dataset {name!r}: key 'paths': {pattern!r}: folder", blocked)
      raise ConfigError(
          f"dataset {name!r}: key 'paths': {pattern!r} matches no files "
          f"(looked for {full})"
      )
    denied = sorted(p for p in matched if not _may(p, os.R_OK))
    if denied:
      more = f" (and {len(denied) - 1} more of its {len(matched)} files)" if len(denied) > 1 else ""
      raise unreadable(f"dataset {name!r}: key 'paths': {pattern!r}: file",
                       os.path.abspath(denied[0]), more)
    files.update(os.path.abspath(p) for p in matched)
  if len({urls.is_url(f) for f in files}) > 1:
    raise ConfigError(f"dataset {name!r}: key 'paths' mixes local files and bucket URLs; "
                      "a dataset's shards are all in one place")
  return files


def _parse_tfds(name: str, table: dict[str, Any], base_dir: pathlib.Path) -> TfdsSplit:
  """`tfds`, `split` (default "train") and `data_dir` (relative to the
  config's folder; default TFDS's own), resolved to the split's shards now."""
  if "paths" in table:
    raise ConfigError(f"dataset {name!r}: give 'paths' or 'tfds', not both")
  tfds_name = table["tfds"]
  _expect(name, "tfds", tfds_name, str, 'a TFDS name such as "mnist" or "mnist:3.0.1"')
  if not tfds_name.strip():
    raise ConfigError(f"dataset {name!r}: key 'tfds' is empty")
  split = table.get("split", "train")
  _expect(name, "split", split, str, 'a TFDS split such as "train" or "train[:90%]"')
  data_dir = table.get("data_dir")
  if data_dir is not None:
    _expect(name, "data_dir", data_dir, str, "a folder path")
    if "://" in data_dir:
      raise ConfigError(f"dataset {name!r}: key 'data_dir': {data_dir!r}: a TFDS data_dir "
                        "in a bucket is not read yet; give its shards as 'paths' "
                        "(gs://.../NAME-train.array_record-*), or copy it to a local folder")
    data_dir = str((base_dir / os.path.expanduser(data_dir)).resolve())
  from grain_elevator.server.data import tfds_source  # pylint: disable=g-import-not-at-top
  return tfds_source.resolve(name, tfds_name.strip(), split, data_dir)


def _parse_weights(name: str, where: str, weights: Any) -> tuple[tuple[str, float], ...]:
  if not isinstance(weights, dict) or not weights:
    raise ConfigError(f"dataset {name!r}: {where} must be a table of component = weight, "
                      f"got {weights!r}")
  for component, w in weights.items():
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0 or w == float("inf"):
      raise ConfigError(f"dataset {name!r}: {where}: weight of {component!r} must be a "
                        f"finite number >= 0, got {w!r}")
  total = sum(weights.values())
  if total <= 0:
    raise ConfigError(f"dataset {name!r}: {where}: the weights are all zero")
  return tuple((c, w / total) for c, w in weights.items())


def _parse_mixture(name: str, table: dict[str, Any]) -> DatasetConfig:
  other = sorted(set(table) - _MIXTURE_KEYS)
  if other or len(_MIXTURE_KEYS & set(table)) != 1:
    raise ConfigError(
        f"dataset {name!r}: a mixture has 'mixture' or 'schedule', not both, and no other "
        f"key (its components keep their own); got {', '.join(map(repr, sorted(table)))}")
  if "mixture" in table:
    return DatasetConfig(name=name, files=(), schedule=(
        (0, _parse_weights(name, "key 'mixture'", table["mixture"])),))
  entries = table["schedule"]
  if not isinstance(entries, list) or not entries:
    raise ConfigError(f"dataset {name!r}: 'schedule' must be [[datasets.{name}.schedule]] "
                      "entries with 'step' and 'weights'")
  segments, last = [], -1
  for i, entry in enumerate(entries):
    where = f"schedule entry {i}"
    if not isinstance(entry, dict) or set(entry) != {"step", "weights"}:
      raise ConfigError(f"dataset {name!r}: {where} must have exactly 'step' and 'weights', "
                        f"got {entry!r}")
    step = entry["step"]
    _expect(name, f"{where}: 'step'", step, int, "an integer >= 0")
    if i == 0 and step != 0:
      raise ConfigError(f"dataset {name!r}: the schedule must start at step 0, got {step}")
    if step <= last:
      raise ConfigError(f"dataset {name!r}: schedule steps must increase: entry {i} has "
                        f"step {step} after {last}")
    last = step
    segments.append((step, _parse_weights(name, where + ": 'weights'", entry["weights"])))
  return DatasetConfig(name=name, files=(), schedule=tuple(segments))


def check_mixtures(datasets: dict[str, DatasetConfig]) -> None:
  """Every mixture's components are registered datasets that are not mixtures,
  and a stream's `source` is a registered mixture of fixed weights."""
  for name, config in datasets.items():
    if config.source is not None:
      target = datasets.get(config.source)
      if target is None or target.schedule is None or len(target.schedule) != 1:
        raise ConfigError(
            f"dataset {name!r}: key 'source' must name a registered mixture of fixed "
            f"weights (mixture = {{...}}), got {config.source!r}"
            + ("" if target is None else " (a dataset that is not one)" if target.schedule
               is None else " (a mixture with a schedule)"))
    for _, weights in config.schedule or ():
      for component, _ in weights:
        target = datasets.get(component)
        if target is None:
          raise ConfigError(f"dataset {name!r}: unknown component {component!r}; registered: "
                            f"{', '.join(sorted(n for n in datasets if n != name))}")
        if target.schedule is not None:
          raise ConfigError(f"dataset {name!r}: component {component!r} is itself a mixture")
        if target.names_a_stream:
          raise ConfigError(f"dataset {name!r}: component {component!r} is a stream dataset "
                            "(iter_pipeline, batch_fn or source); a mixture's components "
                            "are read by record position")


def parse_dataset(name: str, table: Any, base_dir: pathlib.Path) -> DatasetConfig:
  """Validates one dataset table; every error names the dataset and key."""
  if not isinstance(table, dict):
    raise ConfigError(f"dataset {name!r}: [datasets.{name}] must be a table")
  if _MIXTURE_KEYS & set(table):
    return _parse_mixture(name, table)
  unknown = sorted(set(table) - _KEYS)
  if unknown:
    raise ConfigError(
        f"dataset {name!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
        f"allowed: {', '.join(sorted(_KEYS))}"
    )
  given = [k for k in _SOURCE_KEYS if k in table]
  if len(given) > 1:
    raise ConfigError(f"dataset {name!r}: give one of {', '.join(map(repr, _SOURCE_KEYS))}, "
                      f"not {' and '.join(map(repr, given))}")
  source = table.get("source")
  storage = None
  if "storage" in table:
    if "paths" not in table:
      raise ConfigError(f"dataset {name!r}: [datasets.{name}.storage] goes with bucket "
                        "'paths' (gs://, s3://, az://)")
    storage = storage_settings.parse(name, table["storage"])
  tfds_split, files = None, set()
  if source is not None:
    _expect(name, "source", source, str, "the name of a registered mixture")
    stray = sorted((_TFDS_KEYS | {"seed", "shuffle", "num_epochs"}) & set(table))
    if stray:
      raise ConfigError(f"dataset {name!r}: key(s) {', '.join(map(repr, stray))} mean "
                        "nothing with 'source': the mixture's components keep their own, "
                        "and its records repeat forever")
  elif "tfds" in table:
    tfds_split = _parse_tfds(name, table, base_dir)
    files = set(tfds_split.files)
  else:
    files = _expand_paths(name, table, base_dir, storage)

  seed = table.get("seed", 0)
  _expect(name, "seed", seed, int, "an integer in [0, 2**32)")
  if not 0 <= seed < 2**32:
    raise ConfigError(f"dataset {name!r}: key 'seed' must be in [0, 2**32), got {seed}")
  shuffle = table.get("shuffle", True)
  _expect(name, "shuffle", shuffle, bool, "true or false")
  num_epochs = table.get("num_epochs", 0 if source is not None else 1)  # a mixture: forever
  _expect(name, "num_epochs", num_epochs, int, "an integer >= 0 (0 = forever)")
  if num_epochs < 0:
    raise ConfigError(
        f"dataset {name!r}: key 'num_epochs' must be >= 0 (0 = forever), got {num_epochs}"
    )
  drop_remainder = table.get("drop_remainder", True)
  _expect(name, "drop_remainder", drop_remainder, bool, "true or false")
  if not drop_remainder and num_epochs == 0:
    raise ConfigError(
        f"dataset {name!r}: drop_remainder = false (evaluation mode) needs a finite "
        "num_epochs: a stream that repeats forever has no final batch to pad")
  pipeline = table.get("pipeline")
  if pipeline is not None:
    _expect(name, "pipeline", pipeline, str, "a 'package.module:function' string")
  batch_transform = table.get("batch_transform")
  if batch_transform is not None:
    _expect(name, "batch_transform", batch_transform, str,
            "a 'package.module:function' string")
  options = table.get("options", {})
  _expect(name, "options", options, dict, "a table of keyword arguments")
  if options and pipeline is None and batch_transform is None:
    raise ConfigError(f"dataset {name!r}: key 'options' given without a 'pipeline'")
  iter_pipeline, batch_fn = table.get("iter_pipeline"), table.get("batch_fn")
  for key, value in (("iter_pipeline", iter_pipeline), ("batch_fn", batch_fn)):
    if value is not None:
      _expect(name, key, value, str, "a 'package.module:function' string")
  iter_options = table.get("iter_options", {})
  _expect(name, "iter_options", iter_options, dict, "a table of keyword arguments")
  if iter_options and iter_pipeline is None:
    raise ConfigError(f"dataset {name!r}: key 'iter_options' given without an "
                      "'iter_pipeline'")
  stream_shards = table.get("stream_shards", 1)
  _expect(name, "stream_shards", stream_shards, int,
          f"an integer in [1, {limits.MAX_STREAM_SHARDS}]")
  if not 1 <= stream_shards <= limits.MAX_STREAM_SHARDS:
    raise ConfigError(f"dataset {name!r}: key 'stream_shards' must be in "
                      f"[1, {limits.MAX_STREAM_SHARDS}] (MAX_STREAM_SHARDS), got {stream_shards}")
  if batch_transform is not None and (iter_pipeline or batch_fn or source
                                      or stream_shards > 1):
    raise ConfigError(f"dataset {name!r}: 'batch_transform' is a whole-batch fast path for "
                      "a 1:1 pipeline; a stream dataset ('iter_pipeline', 'batch_fn', "
                      "'source', 'stream_shards') batches with Grain ('batch_fn')")

  config = DatasetConfig(
      name=name, files=tuple(sorted(files)), pipeline=pipeline,
      batch_transform=batch_transform, seed=seed,
      shuffle=shuffle, num_epochs=num_epochs, drop_remainder=drop_remainder,
      options=dict(options), tfds=tfds_split, source=source,
      iter_pipeline=iter_pipeline, batch_fn=batch_fn, iter_options=dict(iter_options),
      base_dir=str(base_dir), storage=storage, stream_shards=stream_shards,
  )
  config.pipeline_fn()  # Fail at start-up, not on the first request.
  config.batch_transform_fn()
  config.iter_pipeline_fn()
  config.batch_fn_fn()
  return config


def load_config(path: str | os.PathLike[str]) -> ServerConfig:
  """Reads and validates a server config file."""
  path = pathlib.Path(path).expanduser().resolve()
  try:
    with open(path, "rb") as f:
      data = tomllib.load(f)
  except FileNotFoundError as e:
    raise ConfigError(f"config file {str(path)!r} does not exist") from e
  except PermissionError as e:
    raise unreadable("config file", str(path)) from e
  except OSError as e:
    raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from e
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
  unknown = sorted(set(data) - _TOP_KEYS)
  if unknown:
    raise ConfigError(
        f"config {str(path)!r}: unknown top-level key(s) "
        f"{', '.join(map(repr, unknown))}; datasets go under [datasets.NAME]"
    )
  tables = data.get("datasets")
  if not isinstance(tables, dict) or not tables:
    raise ConfigError(f"config {str(path)!r} defines no [datasets.NAME] table")
  datasets = {
      name: parse_dataset(name, table, path.parent) for name, table in tables.items()
  }
  check_mixtures(datasets)
  return ServerConfig(path=str(path), datasets=datasets)
