"""Which library reads byte ranges of objects best: obstore (Rust's
object_store), fsspec's s3fs, tensorstore's kvstore, on moto's S3 server
(storage_servers.py) on 127.0.0.1, optionally behind the fault proxy at a
fixed latency per request.

  python -m grain_elevator.tools.bench.storage_libs [--latency-ms 20] [--rounds 2]

Each library reads the same random ranges (64 KiB and 1 MiB, the extents
of small-record chunks and of big records) of 4 objects, `--in-flight`
requests at a time, in interleaved rounds; it reports MB/s and this
process's CPU seconds per GB read (moto runs in its own process). Used to
choose the storage library (BENCHMARKS.md, "Object storage libraries").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import time
from typing import Callable

from grain_elevator.tools.testing.fault_proxy import FaultProxy
from grain_elevator.tools.testing.storage_servers import S3Server

BUCKET = "bench"
# moto copies or hashes the whole object for each ranged GET (~1.5 ms per MiB
# here): small objects keep the server from hiding the clients.
OBJECT_BYTES = 2 << 20
NUM_OBJECTS = 4


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _ranges(size: int, total: int, seed: int) -> list[tuple[str, int, int]]:
  rng = random.Random(seed)
  out = []
  for _ in range(max(1, total // size)):
    start = rng.randrange(0, OBJECT_BYTES - size)
    out.append((f"obj-{rng.randrange(NUM_OBJECTS)}", start, start + size))
  return out


def obstore_reader(endpoint: str, in_flight: int) -> Callable[[list], int]:
  import obstore  # pylint: disable=g-import-not-at-top
  from obstore.store import S3Store  # pylint: disable=g-import-not-at-top
  store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})
  loop = asyncio.new_event_loop()

  async def run(ranges):
    sem = asyncio.Semaphore(in_flight)

    async def one(key, a, b):
      async with sem:
        return len(await obstore.get_range_async(store, key, start=a, end=b))
    return sum(await asyncio.gather(*(one(*r) for r in ranges)))
  return lambda ranges: loop.run_until_complete(run(ranges))


def s3fs_reader(endpoint: str, in_flight: int) -> Callable[[list], int]:
  import s3fs  # pylint: disable=g-import-not-at-top
  fs = s3fs.S3FileSystem(endpoint_url=endpoint, use_listings_cache=False)

  def read(ranges):
    out = fs.cat_ranges([f"{BUCKET}/{k}" for k, _, _ in ranges], [a for _, a, _ in ranges],
                        [b for _, _, b in ranges], batch_size=in_flight)
    return sum(len(x) for x in out)
  return read


def tensorstore_reader(endpoint: str, in_flight: int) -> Callable[[list], int]:
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  kv = ts.KvStore.open({"driver": "s3", "bucket": BUCKET, "endpoint": endpoint,
                        "aws_region": os.environ["AWS_REGION"],
                        "context": {"s3_request_concurrency": {"limit": in_flight}}}).result()

  def read(ranges):
    total = 0
    for i in range(0, len(ranges), in_flight):
      futures = [kv.read(k, byte_range=slice(a, b)) for k, a, b in ranges[i:i + in_flight]]
      total += sum(len(f.result().value) for f in futures)
    return total
  return read


LIBRARIES = {"obstore": obstore_reader, "s3fs": s3fs_reader, "tensorstore": tensorstore_reader}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--latency-ms", type=float, default=0.0)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--in-flight", type=int, default=32)
  p.add_argument("--megabytes", type=int, default=128, help="read per library, size and round")
  p.add_argument("--libraries", default=",".join(LIBRARIES))
  p.add_argument("--direct", action="store_true", help="no proxy (--latency-ms ignored)")
  args = p.parse_args(argv)
  with S3Server() as s3:
    s3.create_bucket(BUCKET)
    for i in range(NUM_OBJECTS):
      s3.put(BUCKET, f"obj-{i}", os.urandom(OBJECT_BYTES))
    with FaultProxy(s3.url, latency_s=args.latency_ms / 1000) as proxy:
      endpoint = s3.url if args.direct else proxy.url
      os.environ.update(s3.env(endpoint))
      readers = {name: LIBRARIES[name](endpoint, args.in_flight)
                 for name in args.libraries.split(",")}
      where = "directly" if args.direct else f"behind the proxy at {args.latency_ms:g} ms a request"
      print(f"moto S3 on 127.0.0.1 {where}, "
            f"{args.in_flight} in flight, {args.megabytes} MB per library, size and round")
      print(f"{'library':<12} {'range':>7} {'MB/s':>8} {'CPU s/GB':>9}")
      for size in (64 << 10, 1 << 20):
        results: dict[str, list[tuple[float, float]]] = {n: [] for n in readers}
        for rnd in range(args.rounds):
          ranges = _ranges(size, args.megabytes << 20, seed=rnd * 7 + size)
          for name, read in readers.items():  # interleaved: each round, every library
            read(ranges[:4])  # warm connections
            t0, c0 = time.perf_counter(), _cpu()
            got = read(ranges)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
            results[name].append((got / wall / 1e6, cpu / (got / 1e9)))
        for name, rows in results.items():
          best = max(rows)
          print(f"{name:<12} {size >> 10:>5}Ki {best[0]:>8.0f} {min(r[1] for r in rows):>9.2f}")


if __name__ == "__main__":
  main()
