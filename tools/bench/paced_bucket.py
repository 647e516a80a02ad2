"""A trainer paced at N records/s of 100 KB records read from a bucket: does
the server keep its pace, and does it keep as many requests in flight as
Little's law asks?

  python -m grain_elevator.tools.bench.paced_bucket [--pace 2000] [--ttfb-ms 120,600]
      [--workers 2] [--seconds 20] [--records 8192] [--data DIR]

Records of 99,916 B as stored (uint8 pixels, no decode: what the server's
reads cost, not a pipeline's), in 8 shards, G=32, served by `elevator serve
--workers W --batch-cache-mb 0` from the stand-in store
(tools/testing/object_store.py) at the time to first byte given, and, in the
same run, the same server from local files. The trainer takes a batch, then
waits until G/N s after the last one (a step that takes that long); a batch
late is time lost, as for a real trainer. Printed, each beside the limit:
records/s against the pace, and the store's mean requests in flight against
Little's law (the GETs a second asked for x the store's mean time to first
byte).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import threading
import time
from typing import Any

from grain_elevator.tools.bench import workloads as workloads_lib

BUCKET = "paced"
G = 32
WORKLOAD = workloads_lib.Workload("record100k", 100, 333, 3, False, G, 8192)


def _shards(root: pathlib.Path, records: int) -> tuple[str, str]:
  """(local config, bucket config) over the same shards."""
  config = workloads_lib.prepare(root / "data", WORKLOAD, records, num_shards=8)
  objects = root / "store" / BUCKET / WORKLOAD.name
  objects.mkdir(parents=True, exist_ok=True)
  for f in workloads_lib.shard_files(root / "data", WORKLOAD):
    target = objects / os.path.basename(f)
    if not target.exists():
      os.link(f, target)
  text = pathlib.Path(config).read_text().replace(
      f'paths = ["{WORKLOAD.name}/*.array_record"]',
      f'paths = ["s3://{BUCKET}/{WORKLOAD.name}/*.array_record"]')
  remote = root / "data" / "bucket.toml"
  remote.write_text(text)
  return config, str(remote)


def _measure(config: str, store: Any, pace: float, workers: int, seconds: float
             ) -> dict[str, float]:
  import psutil  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  server = LocalServer(config, workers=workers, env=store.env(),
                       extra_args=["--batch-cache-mb", "0"])
  try:
    root = psutil.Process(server.proc.pid)
    procs = [root, *root.children(recursive=True)]
    taken, stop = [0], threading.Event()

    def trainer() -> None:
      with RemoteDataset(server.target, WORKLOAD.name, G) as ds:
        it = iter(ds)
        due = time.monotonic()
        while not stop.is_set():
          next(it)
          taken[0] += 1
          due += G / pace
          wait = due - time.monotonic()
          if wait > 0:
            time.sleep(wait)
          else:
            due = time.monotonic()  # late: that time is lost, not made up

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    time.sleep(min(8.0, seconds / 2))  # the first epoch's plans under way
    store.reset_stats()
    cpu0, n0, t0 = sum(sum(p.cpu_times()[:2]) for p in procs), taken[0], time.monotonic()
    time.sleep(seconds)
    cpu1, n1, t1 = sum(sum(p.cpu_times()[:2]) for p in procs), taken[0], time.monotonic()
    stop.set()
    thread.join(60)
    stats = store.stats()
  finally:
    server.stop()
  rate = (n1 - n0) * G / (t1 - t0)
  ttfb = stats["ttfb_sum_s"] / max(1, stats["ttfb_draws"])
  gets = stats["ranged_gets"] / max(1e-9, stats["window_s"])
  return {"records_per_s": rate, "server_cores": (cpu1 - cpu0) / (t1 - t0), "gets_per_s": gets,
          "ttfb_s": ttfb, "in_flight": stats["in_flight_mean"],
          "in_flight_peak": stats["in_flight_peak"], "little": gets * ttfb}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--pace", type=float, default=2000.0, help="records/s (default %(default)g)")
  p.add_argument("--ttfb-ms", default="120,600",
                 help="the store's time to first byte, P50,P99 (default %(default)s)")
  p.add_argument("--workers", type=int, default=2, help="(default %(default)s)")
  p.add_argument("--seconds", type=float, default=20.0, help="(default %(default)g)")
  p.add_argument("--records", type=int, default=8192, help="(default %(default)s)")
  p.add_argument("--data", help="where the shards and the store's folder go (default: "
                                "TMPDIR/grain-elevator-bench/paced)")
  args = p.parse_args(argv)
  from grain_elevator.tools.testing.object_store import StandInStore  # pylint: disable=g-import-not-at-top
  p50, p99 = (float(x) for x in args.ttfb_ms.split(","))
  root = pathlib.Path(args.data or pathlib.Path(tempfile.gettempdir()) / "grain-elevator-bench"
                      / "paced")
  local, remote = _shards(root, args.records)
  with StandInStore(root / "store", "s3", ttfb_p50_ms=p50, ttfb_p99_ms=p99) as store:
    got = {name: _measure(config, store, args.pace, args.workers, args.seconds)
           for name, config in (("bucket", remote), ("local files", local))}
  print(f"| W={args.workers}, pace {args.pace:,.0f} records/s of {WORKLOAD.record_bytes:,} B, "
        f"store p50 {p50:g} ms / p99 {p99:g} ms | records/s | × pace | server cores | "
        "requests in flight (peak) | Little's law (GETs/s × mean wait) | × Little |")
  print("|---|---|---|---|---|---|---|")
  for name, r in got.items():
    little = (f"{r['little']:.0f} ({r['gets_per_s']:,.0f} × {1e3 * r['ttfb_s']:.0f} ms) | "
              f"{r['in_flight'] / r['little']:.2f}" if r["gets_per_s"] else "n/a | n/a")
    print(f"| {name} | {r['records_per_s']:,.0f} | {r['records_per_s'] / args.pace:.2f} | "
          f"{r['server_cores']:.2f} | {r['in_flight']:.0f} ({r['in_flight_peak']}) | {little} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
