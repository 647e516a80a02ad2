"""Reads a whole stream at a trainer's pace, with RemoteDataset's default
settings, and compares each step with embedded mode.

At step `--hold-at` it prints "AT <step>" and waits for a line on stdin, so
a test can change the service under it mid-stream (tests/client/transport/test_dns.py runs
it inside a network namespace). Prints "OK <steps>" at the end, then
"SERVED <address>=<steps> ..." over the connections still open; the
client's log goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time

import numpy as np

from grain_elevator.client import RemoteDataset, TransportOptions


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("-G", type=int, default=8)
  p.add_argument("--hold-at", type=int, default=-1)
  p.add_argument("--step-s", type=float, default=0.0, help="a training step's time")
  p.add_argument("--dns-refresh-s", type=float, default=None,
                 help="TransportOptions.dns_refresh_s (default: its default)")
  a = p.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                      force=True)  # grain may have configured the root logger first
  options = {} if a.dns_refresh_s is None else {
      "transport": TransportOptions(dns_refresh_s=a.dns_refresh_s)}
  with RemoteDataset(a.target, a.dataset, a.G, **options) as remote, \
       RemoteDataset.embedded(a.config, a.dataset, a.G, prefetch=0) as local:
    steps = 0
    it = iter(remote)
    for k, (x, y) in enumerate(zip(it, local, strict=True)):
      for key in y:
        if not np.array_equal(x[key], y[key]):
          print(f"step {k} leaf {key} differs", flush=True)
          return 1
      steps += 1
      if k == a.hold_at:
        print(f"AT {k}", flush=True)
        sys.stdin.readline()
      time.sleep(a.step_s)
    served = collections.Counter()
    for slot in it._backend.data_slots():  # pylint: disable=protected-access
      served[slot.conn.host] += slot.served
  print(f"OK {steps}", flush=True)
  print("SERVED " + " ".join(f"{host}={n}" for host, n in sorted(served.items())), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
