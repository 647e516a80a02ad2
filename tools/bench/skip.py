"""What a skip of packed batches costs: `iterator.skip(n)` on the text workload.

A stream dataset's batch k+1 depends on every element before it (the packer
fills its rows from them), so skipping n batches means computing them; the
server does that in one Skip call and sends none of them. This measures,
on one server with its default workers, per round and in alternating order:

  skip: `it.skip(n)` from step s (the server's fast-forward), then one batch;
  read: reading the n batches from step s over the default transport.

The batch after the skip is checked bit for bit against the batch after the
read. Each round starts at its own step s, reached by a skip that is not
timed, so no round is served from what an earlier one left in a cache.

Usage: python -m grain_elevator.tools.bench.skip [--steps 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.bench import text as text_bench
from grain_elevator.tools.testing.launcher import LocalServer


def _iterator(target: str, g: int, start: int):
  ds = RemoteDataset(target, text_bench.WORKLOAD.name, g)
  it = iter(ds)
  it.skip(start)  # not timed: where this round starts
  return ds, it


def _skip(target: str, g: int, start: int, n: int) -> tuple[float, dict]:
  ds, it = _iterator(target, g, start)
  with ds:
    began = time.perf_counter()
    it.skip(n)
    took = time.perf_counter() - began
    return took, next(it)


def _read(target: str, g: int, start: int, n: int) -> tuple[float, int, dict]:
  ds, it = _iterator(target, g, start)
  with ds:
    began = time.perf_counter()
    sent = 0
    for _ in range(n):
      sent += sum(a.nbytes for a in next(it).values())
    took = time.perf_counter() - began
    return took, sent, next(it)


def run(data: pathlib.Path, steps: int, rounds: int, documents: int) -> dict[str, list[float]]:
  w = text_bench.WORKLOAD
  config, _ = text_bench.prepare(data, w, documents)
  out: dict[str, list[float]] = {"skip_s": [], "read_s": [], "read_bytes": []}
  with LocalServer(config) as server:
    for r in range(rounds):
      start = 1 + r * (steps + 1)
      order = ("skip", "read") if r % 2 == 0 else ("read", "skip")
      after: dict[str, dict] = {}
      for kind in order:
        if kind == "skip":
          took, after["skip"] = _skip(server.target, w.global_batch_size, start, steps)
          out["skip_s"].append(took)
        else:
          took, sent, after["read"] = _read(server.target, w.global_batch_size, start, steps)
          out["read_s"].append(took)
          out["read_bytes"].append(sent)
      for key in after["read"]:
        if not np.array_equal(after["read"][key], after["skip"][key]):
          raise SystemExit(f"round {r}: the batch after the skip differs from the batch "
                           f"after reading ({key})")
      print(f"round {r}: skip {out['skip_s'][-1]:.2f}s, read {out['read_s'][-1]:.2f}s "
            f"({out['read_bytes'][-1] / 1e6:.0f} MB)", flush=True)
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.skip",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--data", default=str(pathlib.Path(tempfile.gettempdir()) / "elevator-bench"))
  p.add_argument("--steps", type=int, default=1000, help="batches skipped (default %(default)s)")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--documents", type=int, default=text_bench.WORKLOAD.default_records)
  a = p.parse_args(argv)
  pathlib.Path(a.data).mkdir(parents=True, exist_ok=True)
  r = run(pathlib.Path(a.data), a.steps, a.rounds, a.documents)
  w = text_bench.WORKLOAD
  skip, read = statistics.median(r["skip_s"]), statistics.median(r["read_s"])
  print(f"text workload, G={w.global_batch_size}, rows of {w.length} tokens, "
        f"{a.steps} batches, W={os.cpu_count()} (defaults), median of {a.rounds}:")
  print(f"  skip: {skip:.2f}s, batch bytes sent 0")
  print(f"  read: {read:.2f}s, batch bytes sent {statistics.median(r['read_bytes']) / 1e6:.0f} MB")
  print(f"  skip / read: {skip / read:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
