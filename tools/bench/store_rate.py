"""The stand-in object store's ceiling (tools/testing/object_store.py): how
many ranged GETs a second it answers, and its CPU seconds per GET, so a
bench that reads through it knows the store is not what it measures.

  python -m grain_elevator.tools.bench.store_rate [--kind s3|gcs|both] [--seconds 3]
      [--in-flight 200] [--size 3080]

The store runs in its own process with no time to first byte, serving one
object; a second process (spawned) reads it with obstore, `in_flight`
ranged GETs at a time (`get_async` with a range, through a store built as
the server builds its own: settings.py's build_store, from the store's
`env()`). The reader's process resets the store's stats after a warm-up and
reads them at the end, so the GETs and the CPU counted are the window's.

`bare_reads` is the bare reader a bench puts beside a server (buckets.py):
obstore GETs of given byte ranges from a running store, as the server sends
them (a store built by settings.py's build_store, `get_async` with a range
and the object's ETag), `in_flight` at a time, and its CPU per GET.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import tempfile
import time
import urllib.request
from typing import Any

from grain_elevator.tools.testing.object_store import StandInStore

BUCKET = "rate"
KEY = "shard/object.bin"
WARM_UP_S = 0.5


def _control(url: str, method: str, name: str) -> dict[str, Any]:
  req = urllib.request.Request(f"{url}/_standin/{name}", method=method,
                               data=b"{}" if method == "POST" else None)
  with urllib.request.urlopen(req, timeout=30) as r:
    return json.loads(r.read())


def _read(kind: str, env: dict[str, str], url: str, seconds: float, in_flight: int,
          size: int) -> dict[str, Any]:
  """In the reader's process: GETs of the whole object as a range, `in_flight`
  at a time, for `seconds` after a warm-up."""
  os.environ.update(env)
  from grain_elevator.server.data.storage import settings as settings_lib  # pylint: disable=g-import-not-at-top
  import obstore  # pylint: disable=g-import-not-at-top
  store = settings_lib.build_store("s3" if kind == "s3" else "gs", BUCKET,
                                   settings_lib.StorageSettings(retry_s=30.0))

  async def run() -> dict[str, Any]:
    deadline = 0.0
    gets = 0

    async def reader() -> None:
      nonlocal gets
      while time.perf_counter() < deadline:
        result = await obstore.get_async(store, KEY, options={"range": (0, size)})
        data = await result.bytes_async()
        if len(data) != size:
          raise AssertionError(f"read {len(data)} bytes of {size}")
        gets += 1

    deadline = time.perf_counter() + WARM_UP_S  # every connection opened
    await asyncio.gather(*(reader() for _ in range(in_flight)))
    _control(url, "POST", "reset")
    gets = 0
    began = time.perf_counter()
    cpu = time.process_time()
    deadline = began + seconds
    await asyncio.gather(*(reader() for _ in range(in_flight)))
    elapsed = time.perf_counter() - began
    return {"gets": gets, "elapsed_s": elapsed, "reader_cpu_s": time.process_time() - cpu,
            "store": _control(url, "GET", "stats")}

  return asyncio.run(run())


def ceiling(kind: str = "s3", seconds: float = 3.0, in_flight: int = 200,
            size: int = 3080) -> dict[str, Any]:
  """GETs a second the store answered and its CPU seconds per GET, with
  what the reader saw (its own CPU, the store's mean depth)."""
  with tempfile.TemporaryDirectory(prefix="elevator-store-rate-") as root:
    with StandInStore(root, kind, ttfb=0) as store:
      store.create_bucket(BUCKET)
      store.put(BUCKET, KEY, os.urandom(size))
      spawn = multiprocessing.get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        got = pool.submit(_read, kind, store.env(), store.url, seconds, in_flight,
                          size).result()
  stats = got["store"]
  served = stats["ranged_gets"]
  return {"kind": kind, "in_flight": in_flight, "size": size,
          "gets_per_s": got["gets"] / got["elapsed_s"],
          "store_cpu_s_per_get": stats["window_cpu_s"] / served if served else float("nan"),
          "store_cpu_share": stats["window_cpu_s"] / stats["window_s"],
          "reader_cpu_s_per_get": got["reader_cpu_s"] / got["gets"] if got["gets"] else float("nan"),
          "store_in_flight_mean": stats["in_flight_mean"], "gets": got["gets"],
          "statuses": stats["statuses"]}


def bare_reads(arg: dict[str, Any]) -> dict[str, Any]:
  """In a process of its own (harness.forked): GETs of `arg["ranges"]`
  ([key, begin, end, etag], cycled in a random order) from bucket
  `arg["bucket"]` of the store that `arg["env"]` reaches, `arg["in_flight"]`
  at a time, for `arg["seconds"]` after `arg["warmup_s"]`: GETs, bytes, this
  process's CPU seconds, and the store's stats over the window (its
  `/_standin/` URL is `arg["url"]`)."""
  import random  # pylint: disable=g-import-not-at-top
  os.environ.update(arg["env"])
  from grain_elevator.server.data.storage import settings as settings_lib  # pylint: disable=g-import-not-at-top
  import obstore  # pylint: disable=g-import-not-at-top
  store = settings_lib.build_store("s3", arg["bucket"], settings_lib.StorageSettings(retry_s=30.0))
  ranges = list(arg["ranges"])
  random.Random(0).shuffle(ranges)

  async def run() -> dict[str, Any]:
    deadline = 0.0
    gets = nbytes = 0
    at = 0

    async def reader() -> None:
      nonlocal gets, nbytes, at
      while time.perf_counter() < deadline:
        key, begin, end, etag = ranges[at % len(ranges)]
        at += 1
        options: dict[str, Any] = {"range": (begin, end)}
        if etag:
          options["if_match"] = etag
        result = await obstore.get_async(store, key, options=options)
        nbytes += len(await result.bytes_async())
        gets += 1

    deadline = time.perf_counter() + arg["warmup_s"]
    await asyncio.gather(*(reader() for _ in range(arg["in_flight"])))
    _control(arg["url"], "POST", "reset")
    gets = nbytes = 0
    began, cpu = time.perf_counter(), time.process_time()
    deadline = began + arg["seconds"]
    await asyncio.gather(*(reader() for _ in range(arg["in_flight"])))
    elapsed = time.perf_counter() - began
    return {"gets": gets, "bytes": nbytes, "elapsed_s": elapsed,
            "cpu_s": time.process_time() - cpu, "store": _control(arg["url"], "GET", "stats")}

  out = asyncio.run(run())
  out["cpu_s_per_get"] = out["cpu_s"] / out["gets"] if out["gets"] else float("nan")
  out["gets_per_s"] = out["gets"] / out["elapsed_s"]
  return out


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.store_rate",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--kind", choices=("s3", "gcs", "both"), default="both")
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--in-flight", type=int, default=200)
  p.add_argument("--size", type=int, default=3080)
  a = p.parse_args()
  for kind in ("s3", "gcs") if a.kind == "both" else (a.kind,):
    r = ceiling(kind, a.seconds, a.in_flight, a.size)
    print(f"{kind}: {r['gets_per_s']:,.0f} ranged GETs/s of {a.size} bytes at {a.in_flight} in "
          f"flight; store {r['store_cpu_s_per_get'] * 1e6:.0f} us CPU/GET "
          f"({r['store_cpu_share']:.0%} of a core, {1 / r['store_cpu_s_per_get']:,.0f} GETs/s "
          f"per core), reader {r['reader_cpu_s_per_get'] * 1e6:.0f} us CPU/GET, "
          f"store held {r['store_in_flight_mean']:.1f} requests on average", flush=True)


if __name__ == "__main__":
  main()
