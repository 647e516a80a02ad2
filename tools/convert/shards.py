"""The shard writer every converter shares: deterministic, parallel, atomic.

A converter is a `Source`: a sorted list of input *units* (files, class
folders), a way to *index* one (how many records it yields, and where they
are), and a way to *read* a range of a unit's records as bytes. From the
indexes, `plan` cuts the records, in input order, into `num_shards` shards
of consecutive records (shard s holds records [s*R//N, (s+1)*R//N) of all R),
so what each shard holds depends on the input and N alone, never on the
number of workers or on timing. `write_shard` writes one shard with
ArrayRecord (``group_size:1``, as tools/examples.write_shards);
`convert` runs indexing and writing over a process pool and `Staging` makes
the result appear all at once:

* everything is written into a hidden folder beside OUT_DIR
  (``.NAME.convert-XXXXXXXX.tmp``), each shard first under a temporary name;
* only when every shard is complete is that folder renamed to OUT_DIR, so a
  failed or killed run leaves no OUT_DIR (a killed one may leave the hidden
  folder, which the next run names);
* an OUT_DIR that holds shards is replaced only with ``overwrite``, and only
  when it holds nothing but what a conversion writes;
* an OUT_DIR in a bucket (gs://, s3://, az://) is staged in a local folder
  and uploaded a whole shard an object, the config last (bucket_out.py).

The same functions make up the Beam pipeline (beam.py), whose output is
therefore byte-identical.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Protocol, Sequence

from grain_elevator.server.data.storage import urls
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.bucket_out import BucketStaging
from grain_elevator.tools.convert.errors import ConvertError

# Without --shards: one shard per this many input bytes (at least one).
DEFAULT_SHARD_BYTES = 128 << 20
# ArrayRecord writer options: one record per chunk, as pipelines/examples.py.
WRITER_OPTIONS = "group_size:1"
# What a conversion writes into OUT_DIR besides the shards.
CONFIG_FILE = "elevator.toml"
LABELS_FILE = "labels.txt"
_SHARD_RE = re.compile(r".+-\d{5}-of-\d{5}\.array_record")
_OURS = (CONFIG_FILE, LABELS_FILE)


def written_by_conversion(name: str) -> bool:
  """Whether a file (or object) of OUT_DIR is one a conversion writes."""
  return bool(_SHARD_RE.fullmatch(name)) or name in _OURS


@dataclasses.dataclass(frozen=True)
class Indexed:
  """What indexing one input unit found."""

  count: int  # records it yields
  nbytes: int  # input bytes it holds (the default shard count, MB/s)
  data: Any = None  # where its records are (source-specific, picklable)
  skipped: tuple[tuple[str, str], ...] = ()  # (path, why) inputs left out
  # (what, how many) of the unit's contents left out, e.g. ("blank lines", 3)
  left_out: tuple[tuple[str, int], ...] = ()


class Source(Protocol):
  """An input format. Instances are picklable (they go to worker processes
  and Beam workers) and hold only options and the input's location."""

  kind: str

  def units(self) -> list[str]:
    """The input units in record order."""

  def index(self, unit: str) -> Indexed:
    ...

  def segment(self, unit: str, indexed: Indexed, start: int, stop: int) -> Any:
    """A picklable description of records [start, stop) of `unit`."""

  def read(self, segment: Any, stats: dict[str, Any]) -> Iterator[bytes]:
    """The records of a segment, in order; may note facts in `stats`."""

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ...

  def check(self, indexes: Sequence[tuple[str, Indexed]]) -> None:
    """Raises if the indexed units do not fit together (e.g. schemas differ)."""

  def side_files(self) -> dict[str, bytes]:
    """Files written into OUT_DIR beside the shards (e.g. labels.txt)."""

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    """The pipeline and options that serve the records."""


@dataclasses.dataclass(frozen=True)
class ShardTask:
  index: int
  name: str  # file name: PREFIX-SSSSS-of-NNNNN.array_record
  count: int  # records
  segments: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ShardResult:
  index: int
  name: str
  records: int
  record_bytes: int  # sum of the records' sizes
  file_bytes: int  # size of the shard file
  stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Plan:
  tasks: tuple[ShardTask, ...]
  records: int
  input_bytes: int
  skipped: tuple[tuple[str, str], ...]
  prefix: str
  left_out: tuple[tuple[str, int], ...] = ()  # summed over the units


@dataclasses.dataclass(frozen=True)
class Summary:
  out_dir: str
  name: str
  records: int
  shards: int
  input_bytes: int
  record_bytes: int
  output_bytes: int
  seconds: float
  skipped: tuple[tuple[str, str], ...]
  snippet: str  # the TOML that serves OUT_DIR (absolute paths)
  left_out: tuple[tuple[str, int], ...] = ()

  def lines(self) -> list[str]:
    mb_in, mb_out = self.input_bytes / 1e6, self.output_bytes / 1e6
    s = max(self.seconds, 1e-9)
    out = [f"wrote {self.records:,} records in {self.shards} shards to {self.out_dir}: "
           f"{mb_out:,.1f} MB from {mb_in:,.1f} MB of input in {self.seconds:.1f} s "
           f"({mb_in / s:,.1f} MB/s, {self.records / s:,.0f} records/s)"]
    if self.skipped:
      out.append(f"skipped {len(self.skipped)} input(s), e.g. "
                 + "; ".join(f"{p}: {why}" for p, why in self.skipped[:3]))
    if self.left_out:
      out.append("left out " + ", ".join(f"{n:,} {what}" for what, n in self.left_out))
    return out


def shard_name(prefix: str, index: int, num_shards: int) -> str:
  return f"{prefix}-{index:05d}-of-{num_shards:05d}.array_record"


def shard_glob(prefix: str, num_shards: int) -> str:
  return f"{prefix}-*-of-{num_shards:05d}.array_record"


def plan(indexes: Sequence[tuple[str, Indexed]], source: Source, *,
         num_shards: int | None, prefix: str) -> Plan:
  """Cuts all records, in input order, into shards of consecutive records:
  shard s gets records [s*R//N, (s+1)*R//N)."""
  source.check(indexes)
  total = sum(ix.count for _, ix in indexes)
  nbytes = sum(ix.nbytes for _, ix in indexes)
  skipped = tuple(s for _, ix in indexes for s in ix.skipped)
  left_out: dict[str, int] = {}
  for _, ix in indexes:
    for what, n in ix.left_out:
      left_out[what] = left_out.get(what, 0) + n
  if total == 0:
    raise ConvertError(f"no records found in the {len(indexes)} input(s)"
                       + (f" ({len(skipped)} skipped)" if skipped else ""))
  if num_shards is None:
    num_shards = min(total, max(1, math.ceil(nbytes / DEFAULT_SHARD_BYTES)))
  if not 1 <= num_shards <= min(total, 99999):
    raise ConvertError(f"--shards must be between 1 and {min(total, 99999)} "
                       f"(the number of records), got {num_shards}")
  tasks = []
  unit = 0  # the unit holding the next record
  used = 0  # records of `unit` already planned
  for s in range(num_shards):
    want = (s + 1) * total // num_shards - s * total // num_shards
    segments = []
    while want:
      name, ix = indexes[unit]
      take = min(want, ix.count - used)
      if take:
        segments.append(source.segment(name, ix, used, used + take))
      want -= take
      used += take
      if used == ix.count:
        unit, used = unit + 1, 0
    count = (s + 1) * total // num_shards - s * total // num_shards
    tasks.append(ShardTask(s, shard_name(prefix, s, num_shards), count, tuple(segments)))
  return Plan(tuple(tasks), total, nbytes, skipped, prefix,
              tuple((what, n) for what, n in left_out.items() if n))


def write_shard(source: Source, task: ShardTask, folder: str,
                progress: Callable[[int, int], None] | None = None) -> ShardResult:
  """Writes one shard into `folder`, first under a temporary name, so a
  shard file under its own name is always complete (and a retried or
  duplicated task, as Beam may run, replaces it whole)."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  final = os.path.join(folder, task.name)
  partial = f"{final}.{uuid.uuid4().hex[:8]}.partial"
  stats: dict[str, Any] = {}
  records = nbytes = 0
  pending_records = pending_bytes = 0
  writer = ArrayRecordWriter(partial, WRITER_OPTIONS)
  try:
    for segment in task.segments:
      for record in source.read(segment, stats):
        writer.write(record)
        records += 1
        nbytes += len(record)
        if progress:
          pending_records += 1
          pending_bytes += len(record)
          if pending_records >= 256 or pending_bytes >= 8 << 20:
            progress(pending_records, pending_bytes)
            pending_records = pending_bytes = 0
    if records != task.count:
      raise ConvertError(f"shard {task.name}: read {records} records where indexing "
                         f"found {task.count}: did the input change while converting?")
    writer.close()
    writer = None
    os.replace(partial, final)
  except BaseException:
    if writer is not None:
      try:
        writer.close()
      except Exception:  # pylint: disable=broad-except
        pass
    try:
      os.unlink(partial)
    except OSError:
      pass
    raise
  if progress and pending_records:
    progress(pending_records, pending_bytes)
  return ShardResult(task.index, task.name, records, nbytes, os.path.getsize(final), stats)


def check_replaceable(out_dir: str, entries: list[str], overwrite: bool, *,
                      where: str, things: str) -> None:
  """Raises unless OUT_DIR, holding `entries` (names, sorted), may be
  written: empty, or (overwrite) holding only what a conversion writes.
  `where`/`things`: "folder"/"files", or "prefix"/"objects" for a bucket."""
  if not entries:
    return
  shards = [e for e in entries if e.endswith(".array_record")]
  if not shards:
    raise ConvertError(f"OUT_DIR {out_dir} is not empty (it holds "
                       f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); "
                       f"name a new or empty {where}")
  if not overwrite:
    raise ConvertError(f"OUT_DIR {out_dir} already holds {len(shards)} shard(s) "
                       f"({shards[0]}, ...); pass --overwrite to replace them")
  foreign = [e for e in entries if not written_by_conversion(e)]
  if foreign:
    raise ConvertError(f"OUT_DIR {out_dir} holds {things} a conversion does not "
                       f"write ({', '.join(foreign[:3])}); --overwrite replaces the "
                       f"whole {where}, so move them away first")


class Staging:
  """OUT_DIR's lifecycle: check it may be written, stage into a hidden
  folder beside it, then rename that folder into place, or remove it."""

  def __init__(self, out_dir: str, *, overwrite: bool = False, token: str | None = None):
    self.out_dir = os.path.abspath(os.path.expanduser(out_dir))
    parent, base = os.path.split(self.out_dir.rstrip(os.sep))
    if not base:
      raise ConvertError(f"OUT_DIR {out_dir!r} names no folder")
    self.parent, self.base = parent, base
    self.overwrite = overwrite
    self.token = token or uuid.uuid4().hex[:8]
    self.tmp_dir = os.path.join(parent, f".{base}.convert-{self.token}.tmp")

  def leftovers(self) -> list[str]:
    """Hidden folders of earlier runs that were killed before finishing."""
    pattern = os.path.join(glob.escape(self.parent), f".{glob.escape(self.base)}.convert-*.tmp")
    return sorted(p for p in glob.glob(pattern) if p != self.tmp_dir)

  def check(self) -> None:
    """Raises unless OUT_DIR may be written: absent, empty, or (overwrite)
    holding only what a conversion writes."""
    if not os.path.exists(self.out_dir):
      if self.parent and not os.path.isdir(self.parent):
        try:
          os.makedirs(self.parent, exist_ok=True)
        except OSError as e:
          raise ConvertError(f"cannot create {self.parent}: {e}") from e
      return
    if not os.path.isdir(self.out_dir):
      raise ConvertError(f"OUT_DIR {self.out_dir} exists and is not a folder")
    check_replaceable(self.out_dir, sorted(os.listdir(self.out_dir)), self.overwrite,
                      where="folder", things="files")

  def create(self) -> str:
    os.makedirs(self.tmp_dir)
    return self.tmp_dir

  def commit(self) -> None:
    """Renames the staged folder into place: the shards appear all at once."""
    self.check()  # again: something may have appeared meanwhile
    old = None
    if os.path.isdir(self.out_dir) and os.listdir(self.out_dir):
      old = os.path.join(self.parent, f".{self.base}.convert-{self.token}.old")
      os.rename(self.out_dir, old)
    try:
      os.rename(self.tmp_dir, self.out_dir)  # replaces an empty folder (POSIX)
    except OSError:
      if old is not None:  # put the old one back
        os.rename(old, self.out_dir)
      raise
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)

  def abort(self) -> None:
    shutil.rmtree(self.tmp_dir, ignore_errors=True)


def finish(source: Source, staging: Staging, the_plan: Plan,
           results: Sequence[ShardResult], *, name: str) -> tuple[str, str]:
  """Writes the side files and elevator.toml into the staged folder; returns
  (the snippet with absolute paths, the config file's text)."""
  results = sorted(results, key=lambda r: r.index)
  if [r.index for r in results] != list(range(len(the_plan.tasks))):
    raise ConvertError("not every shard was written")
  stats = source.merge_stats([r.stats for r in results])
  serving = source.serving(stats)
  for file_name, data in source.side_files().items():
    with open(os.path.join(staging.tmp_dir, file_name), "wb") as f:
      f.write(data)
  pattern = shard_glob(the_plan.prefix, len(the_plan.tasks))
  header = (f"{the_plan.records} records in {len(the_plan.tasks)} shards, "
            f"from `elevator convert {source.kind}`",)
  # A local config names its shards relative to itself; one in a bucket, by URL.
  in_config = staging.url(pattern) if isinstance(staging, BucketStaging) else pattern
  config = snippet_lib.render(name, [in_config], serving, header)
  with open(os.path.join(staging.tmp_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
    f.write(config)
  printed = snippet_lib.render(name, [staging.url(pattern) if isinstance(staging, BucketStaging)
                                      else os.path.join(staging.out_dir, pattern)],
                               serving, header)
  return printed, config


def open_staging(out_dir: str, *, overwrite: bool = False,
                 upload_retry_s: float | None = None) -> Staging | BucketStaging:
  """OUT_DIR's staging: a local folder, or a bucket's prefix (bucket_out.py)."""
  if urls.is_url(out_dir):
    return BucketStaging(out_dir, overwrite=overwrite, retry_s=upload_retry_s)
  return Staging(out_dir, overwrite=overwrite)


def default_name(out_dir: str) -> str:
  return os.path.basename(os.path.abspath(os.path.expanduser(out_dir)).rstrip(os.sep))


def usable_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


# -- the local runner: a process pool ------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(source: Source, counters: Any) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
  _WORKER["source"] = source
  _WORKER["counters"] = counters


def _worker_index(unit: str) -> tuple[str, Indexed]:
  return unit, _WORKER["source"].index(unit)


def _worker_write(task: ShardTask, folder: str) -> ShardResult:
  records, nbytes = _WORKER["counters"]

  def progress(n: int, b: int) -> None:
    with records.get_lock():
      records.value += n
    with nbytes.get_lock():
      nbytes.value += b

  return write_shard(_WORKER["source"], task, folder, progress)


class Terminated(KeyboardInterrupt):
  """SIGTERM arrived during a conversion (which then removes what it wrote)."""


def _raise_terminated(signum, frame):  # pylint: disable=unused-argument
  raise Terminated(f"stopped by signal {signum}")


def _bar(enabled: bool, **kwargs):
  if not enabled:
    return None
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)


def convert(source: Source, out_dir: str, *, num_shards: int | None = None,
            workers: int | None = None, overwrite: bool = False, prefix: str = "train",
            name: str | None = None, progress: bool = True,
            log: Callable[[str], None] | None = None,
            upload_retry_s: float | None = None) -> Summary:
  """Converts `source` into ArrayRecord shards in `out_dir`, all or nothing.

  Raises ConvertError (CorruptInputError for damaged inputs) and leaves no
  OUT_DIR behind on any failure, Ctrl-C or SIGTERM included.
  """
  log = log or (lambda line: print(line, file=sys.stderr))
  if not re.fullmatch(r"[A-Za-z0-9_.]+(-?[A-Za-z0-9_.]+)*", prefix):
    raise ConvertError(f"--prefix {prefix!r}: use letters, digits, '_', '.' and single '-'")
  workers = usable_cpus() if workers is None else workers
  if workers < 1:
    raise ConvertError(f"--workers must be >= 1, got {workers}")
  name = name or default_name(out_dir)
  staging = open_staging(out_dir, overwrite=overwrite, upload_retry_s=upload_retry_s)
  staging.check()
  for left in staging.leftovers():
    log(f"note: {left} was left by an interrupted conversion; delete it")
  start = time.monotonic()
  units = source.units()
  pool = None
  ctx = multiprocessing.get_context("spawn")
  counters = (ctx.Value("q", 0), ctx.Value("q", 0))
  previous = None
  if _in_main_thread():
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
  created = False
  try:
    if workers > 1 and len(units) > 1:
      pool = ctx.Pool(min(workers, max(len(units), 1)), _init_worker, (source, counters))
    indexes = _index_all(source, units, pool, progress)
    the_plan = plan(indexes, source, num_shards=num_shards, prefix=prefix)
    staging.create()
    created = True
    if pool is None and workers > 1 and len(the_plan.tasks) > 1:
      pool = ctx.Pool(min(workers, len(the_plan.tasks)), _init_worker, (source, counters))
    results = _write_all(source, the_plan, staging.tmp_dir, pool, counters, progress)
    printed, _ = finish(source, staging, the_plan, results, name=name)
    staging.commit()
  except BaseException:
    if pool is not None:
      pool.terminate()
      pool = None
    if created:
      staging.abort()
    raise
  finally:
    if pool is not None:
      pool.close()
      pool.join()
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  return Summary(
      out_dir=staging.out_dir, name=name, records=the_plan.records,
      shards=len(the_plan.tasks), input_bytes=the_plan.input_bytes,
      record_bytes=sum(r.record_bytes for r in results),
      output_bytes=sum(r.file_bytes for r in results),
      seconds=time.monotonic() - start, skipped=the_plan.skipped, snippet=printed,
      left_out=the_plan.left_out)


def _in_main_thread() -> bool:
  import threading  # pylint: disable=g-import-not-at-top
  return threading.current_thread() is threading.main_thread()


def _index_all(source: Source, units: list[str], pool: Any,
               progress: bool) -> list[tuple[str, Indexed]]:
  bar = _bar(progress and len(units) > 1, total=len(units), unit="input",
             desc=f"indexing {source.kind}")
  out = []
  try:
    if pool is None:
      it = ((u, source.index(u)) for u in units)
    else:
      it = pool.imap(_worker_index, units, chunksize=max(1, min(64, len(units) // 64)))
    for item in it:
      out.append(item)
      if bar is not None:
        bar.update(1)
  finally:
    if bar is not None:
      bar.close()
  return out


def _write_all(source: Source, the_plan: Plan, folder: str, pool: Any, counters: Any,
               progress: bool) -> list[ShardResult]:
  bar = _bar(progress, total=the_plan.records, unit="rec", unit_scale=True,
             desc=f"writing {len(the_plan.tasks)} shards")
  done_records = done_bytes = 0

  def show(n: int, b: int) -> None:
    nonlocal done_records, done_bytes
    done_records += n
    done_bytes += b
    if bar is not None:
      bar.update(n)
      bar.set_postfix_str(f"{done_bytes / 1e6:,.0f} MB", refresh=False)

  try:
    if pool is None:
      return [write_shard(source, t, folder, show) for t in the_plan.tasks]
    pending = [pool.apply_async(_worker_write, (t, folder)) for t in the_plan.tasks]
    records, nbytes = counters
    while True:
      for r in pending:
        if r.ready() and not r.successful():
          r.get()  # raises the worker's error
      finished = all(r.ready() for r in pending)
      show(records.value - done_records, nbytes.value - done_bytes)
      if finished:
        return [r.get() for r in pending]
      time.sleep(0.1)
  finally:
    if bar is not None:
      bar.close()
