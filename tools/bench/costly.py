"""The costly workload's pipeline: cheap bytes, costly records.

A record is 1 KiB, but its pipeline takes WORK_US_PER_RECORD of its
worker's CPU (a feature computation, a tokenizer, an augmentation): a step
of G=64 is 64 KiB and ~0.19 s of one worker. A client that sizes its
requests by bytes alone asks such a server for minutes of work at once.

The work is CPU, not a wait: each record hashes a buffer until its thread
has spent WORK_US_PER_RECORD of CPU time (`time.thread_time`), so a record
costs the same CPU on any machine and under any load, with no calibration
(a contended core only stretches it in wall time, as it would real work).
The pipeline's output is `examples.decode_images`' own: the work changes
no byte. tools/bench/sleeping.py waits as long per record instead.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any

from grain_elevator.pipelines import examples

WORK_US_PER_RECORD = 3_000
RECORDS = 20_000  # 20 MB of shards, written in seconds; repeated forever as the others
# Hashed between clock reads: ~15 µs of work here, well under a record's, so a
# record overshoots its CPU by at most that. Under 2 KiB, so hashlib keeps
# the GIL, as Python-level feature code would.
_BLOCK = bytes(1024)
_HASHES_PER_CHECK = 8


def work(us: float) -> None:
  """Spends `us` microseconds of this thread's CPU."""
  end = time.thread_time() + us / 1e6
  while time.thread_time() < end:
    for _ in range(_HASHES_PER_CHECK):
      hashlib.sha256(_BLOCK).digest()


def _work(record: Any, *, us: float) -> Any:
  work(us)
  return record


def pixels(ds: Any, *, work_us_per_record: float, **options: Any) -> Any:
  """examples.decode_images, each record costing `work_us_per_record` of CPU."""
  return examples.decode_images(ds, **options).map(
      functools.partial(_work, us=work_us_per_record))


def pixels_batch(raw: list[bytes], *, work_us_per_record: float, **options: Any) -> Any:
  """examples.decode_images_batch (the same rows), after the batch's CPU work."""
  work(len(raw) * work_us_per_record)
  return examples.decode_images_batch(raw, **options)
