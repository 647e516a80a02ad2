"""Reads a whole stream from a server and compares it with embedded mode.

Run inside a network namespace by tests/system/test_netns.py; prints "OK <steps>".
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from grain_elevator.client import RemoteDataset, RetryPolicy


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("-G", type=int, default=8)
  a = p.parse_args()
  with RemoteDataset(a.target, a.dataset, a.G, prefetch=8,
                     retry=RetryPolicy(timeout_s=60, request_timeout_s=20)) as remote, \
       RemoteDataset.embedded(a.config, a.dataset, a.G, prefetch=0) as local:
    steps = 0
    for k, (x, y) in enumerate(zip(remote, local, strict=True)):
      for key in y:
        if not np.array_equal(x[key], y[key]):
          print(f"step {k} leaf {key} differs")
          return 1
      steps += 1
  print(f"OK {steps}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
