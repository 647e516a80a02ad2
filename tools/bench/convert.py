"""`elevator convert`'s throughput against the disk it reads from.

A converter earns its keep when it runs near the speed of reading its input.
This writes three inputs (TFRecord of ~110 kB records, TFRecord of 1 kB
records, an ImageNet-style folder of ~114 KB JPEGs), measures how fast the
disk reads them (O_DIRECT, so no page cache; and again from the page cache),
then converts each with 1 worker and with one per usable core, the inputs
in the page cache as a re-run finds them, and prints one table:

    python -m grain_elevator.tools.bench.convert [--data DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import pathlib
import resource
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from grain_elevator.pipelines import images
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert.images import ImageFolderSource
from grain_elevator.tools.convert.tfrecord import TFRecordSource, encode_tfrecord

_BLOCK = 8 << 20


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _write_tfrecords(folder: pathlib.Path, files: int, records: int, size: int) -> None:
  marker = folder / f".complete-{files}-{records}-{size}"
  if marker.exists():
    return
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  per_file = records // files
  for f in range(files):
    with open(folder / f"part-{f:03d}.tfrecord", "wb") as out:
      for _ in range(per_file):
        out.write(encode_tfrecord(rng.bytes(size)))
  marker.touch()


def _write_images(folder: pathlib.Path, n: int) -> None:
  marker = folder / f".complete-{n}"
  if not marker.exists():
    images.write_synthetic_jpegs(str(folder), n, classes=10)
    marker.touch()


def read_mb_per_s(paths: list[str], direct: bool) -> float:
  """MB/s reading `paths` whole; with `direct`, around the page cache."""
  buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT wants
  total, start = 0, time.perf_counter()
  for path in paths:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
      while (n := os.readv(fd, [buf])) > 0:
        total += n
    finally:
      os.close(fd)
  return total / 1e6 / (time.perf_counter() - start)


def _cpu_s() -> float:
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _convert(make_source: Callable[[], Any], out: pathlib.Path, workers: int) -> dict[str, Any]:
  cpu0 = _cpu_s()
  s = shards.convert(make_source(), str(out), num_shards=8, workers=workers,
                     overwrite=True, progress=False, log=_log)
  return {"records": s.records, "mb_in": s.input_bytes / 1e6, "seconds": s.seconds,
          "cpu_s": _cpu_s() - cpu0}


def run(data: pathlib.Path, workers: list[int], scale: float = 1.0) -> dict[str, Any]:
  n = lambda count: max(8, int(count * scale))  # noqa: E731
  inputs = {
      "TFRecord, 110 kB records (8 files)": (data / "tfr-large", lambda d: _write_tfrecords(
          d, 8, n(4_800), 110_000), lambda d: TFRecordSource((str(d / "*.tfrecord"),))),
      "TFRecord, 1 kB records (4 files)": (data / "tfr-small", lambda d: _write_tfrecords(
          d, 4, n(400_000), 1_000), lambda d: TFRecordSource((str(d / "*.tfrecord"),))),
      f"images, ~114 KB JPEGs (10 classes, {n(2_000):,} files)": (
          data / "jpegs", lambda d: _write_images(d, n(2_000)),
          lambda d: ImageFolderSource.of(str(d))),
  }
  rows, all_files = [], []
  for label, (folder, prepare, _) in inputs.items():
    _log(f"preparing {label} in {folder} ...")
    prepare(folder)
    all_files += sorted(p for p in glob.glob(str(folder / "**" / "*"), recursive=True)
                        if os.path.isfile(p) and not os.path.basename(p).startswith("."))
  disk = read_mb_per_s(all_files, direct=True)
  cached = read_mb_per_s(all_files, direct=False)
  _log(f"reading the inputs: {disk:,.0f} MB/s from the disk (O_DIRECT), "
       f"{cached:,.0f} MB/s from the page cache")
  for label, (folder, _, make) in inputs.items():
    files = sum(1 for p in glob.glob(str(folder / "**" / "*"), recursive=True)
                if os.path.isfile(p) and not os.path.basename(p).startswith("."))
    for w in workers:
      r = _convert(lambda: make(folder), data / "out", w)
      r.update(input=label, files=files, workers=w, mb_per_s=r["mb_in"] / r["seconds"],
               files_per_s=files / r["seconds"], records_per_s=r["records"] / r["seconds"])
      r["x_disk"] = r["mb_per_s"] / disk
      _log(f"  {label}, {w} worker(s): {r['mb_per_s']:,.0f} MB/s")
      rows.append(r)
  return {"disk_direct_mb_per_s": disk, "page_cache_mb_per_s": cached,
          "cpus": shards.usable_cpus(), "rows": rows}


def table(report: dict[str, Any]) -> str:
  lines = [f"Disk read (O_DIRECT): {report['disk_direct_mb_per_s']:,.0f} MB/s; page cache: "
           f"{report['page_cache_mb_per_s']:,.0f} MB/s; {report['cpus']} usable cores; 8 "
           "output shards on the same disk.", "",
           "| input | workers | records | MB in | s | files/s | records/s | MB/s | × disk read "
           "| CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["rows"]:
    lines.append(f"| {r['input']} | {r['workers']} | {r['records']:,} | {r['mb_in']:,.0f} | "
                 f"{r['seconds']:.1f} | {r['files_per_s']:,.1f} | {r['records_per_s']:,.0f} | "
                 f"{r['mb_per_s']:,.0f} | {r['x_disk']:.2f} | {r['cpu_s']:.1f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.convert",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "elevator-bench-convert"),
                 help="folder for the inputs and output (reused across runs)")
  p.add_argument("--workers", default=None,
                 help="comma-separated worker counts (default: one and the usable cores)")
  p.add_argument("--scale", type=float, default=1.0,
                 help="multiply every input's record count (default %(default)g: ~1.2 GB of inputs)")
  p.add_argument("--json", default=None, help="also write the results here")
  a = p.parse_args(argv)
  workers = ([int(w) for w in a.workers.split(",")] if a.workers
             else sorted({1, shards.usable_cpus()}))
  report = run(pathlib.Path(a.data), workers, a.scale)
  print(table(report))
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(report, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
