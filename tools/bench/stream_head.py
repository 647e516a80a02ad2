"""A stream dataset's head from a bucket, its reads planned or not.

  python -m grain_elevator.tools.bench.stream_head [--latency-ms 20] [--batches 40]

A stream (decode_images and a batch_fn: a head that keeps the length) over
2,000 32x32 images in 4 shards on moto's S3 server (storage_servers.py)
behind the fault proxy at a fixed latency per request, read in embedded
mode and from a W=2 server (the parallel head), each with the read-ahead
off (`--read-ahead-mb 0`: one ranged GET per element as the head reaches
it) and at its default (server/data/streams/head_reads.py: a block's records at
once). Prints elements/s side by side, the planned ones as a ratio of the
unplanned (BENCHMARKS.md, "Reading from a bucket").
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import tempfile
import time

from grain_elevator.server.data.storage.read_ahead import DEFAULT_READ_AHEAD_MB

CONFIG = """\
[datasets.st]
paths = ["{where}/*.array_record"]
pipeline = "grain_elevator.pipelines.examples:decode_images"
batch_fn = "grain_elevator.pipelines.examples:batch_centered"
seed = 9
[datasets.st.options]
height = 32
width = 32
channels = 3
"""
BUCKET = "bench-stream"
G = 8


def _embedded(config: str, budget_mb: int, batches: int) -> float:
  from grain_elevator.server.data import config as config_lib  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data import registry  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data.storage import read_ahead  # pylint: disable=g-import-not-at-top
  read_ahead.configure(budget_mb << 20)
  st = registry.Datasets(config_lib.load_config(config), open_now=False).get("st")
  start = time.perf_counter()
  for _ in itertools.islice(st.batches(G, st.info.stream_start), batches):
    pass
  return batches * G / (time.perf_counter() - start)


def _served(config: str, budget_mb: int, batches: int) -> float:
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  from grain_elevator.server import Server, ServerOptions  # pylint: disable=g-import-not-at-top
  opts = ServerOptions(port=0, workers=2, metrics_port=0, read_ahead_mb=budget_mb)
  with Server(config, opts) as server, RemoteDataset(server.target, "st", G) as ds:
    it = iter(ds)
    next(it)  # the session is open
    start = time.perf_counter()
    for _ in range(batches):
      next(it)
    return batches * G / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.stream_head")
  parser.add_argument("--latency-ms", type=float, default=20.0)
  parser.add_argument("--batches", type=int, default=40, help="batches of 8 timed per row")
  args = parser.parse_args(argv)
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.fault_proxy import FaultProxy  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.storage_servers import S3Server  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(tempfile.mkdtemp(prefix="elevator-stream-head-"))
  examples.write_image_shards(str(root / "shards"), num_records=2000, num_shards=4,
                              height=32, width=32, channels=3)
  s3 = S3Server()
  try:
    s3.create_bucket(BUCKET)
    for f in sorted((root / "shards").glob("*.array_record")):
      s3.put(BUCKET, f"data/{f.name}", f.read_bytes())
    with FaultProxy(s3.url, latency_s=args.latency_ms / 1000) as proxy:
      os.environ.update(s3.env(proxy.url))
      config = root / "stream.toml"
      config.write_text(CONFIG.format(where=f"s3://{BUCKET}/data"))
      print(f"stream head from moto at {args.latency_ms:g} ms a request, "
            f"{args.batches} batches of {G}:")
      for where, measure in (("embedded", _embedded), ("server W=2", _served)):
        off = measure(str(config), 0, args.batches)
        planned = measure(str(config), DEFAULT_READ_AHEAD_MB, args.batches)
        print(f"  {where:<11} read-ahead off {off:7.0f} elements/s   "
              f"by plan (default) {planned:7.0f} elements/s   {planned / off:5.1f}x")
  finally:
    s3.stop()


if __name__ == "__main__":
  main()
