"""Seed shards for the fuzzer, written by ArrayRecordWriter itself: the
layouts the shard reader meets (group_size 1 and N, zstd and uncompressed),
with small, empty, compressible and big incompressible records (and none), some of
them across 64 KiB block boundaries."""

from __future__ import annotations

import os
import random

from array_record.python.array_record_module import ArrayRecordWriter

# (name, writer options, record sizes; negative: compressible text of that size)
SEEDS: list[tuple[str, str, list[int]]] = [
    ("g1_zstd_small", "group_size:1", [0, 1, 40, -300, 3_000, -5_000, 17, 2, 700]),
    ("g1_none_small", "group_size:1,uncompressed", [5, 0, -200, 1_000, 64, 3]),
    ("g4_zstd", "group_size:4", [10, -20, 30, 0, 500, -600, 7, 8, 9, 2_000, 1]),
    ("g3_none", "group_size:3,uncompressed", [100, 0, -50, 3, 4, 5, 6]),
    ("g1_zstd_big", "group_size:1", [300_001, 12, -150_000, 70_000, 9]),
    ("g2_none_big", "group_size:2,uncompressed", [20, 70_000, 65_400, 5, -2_000]),
    ("g64_zstd", "group_size:64", [3] * 70 + [-100]),
    ("g2_zstd1", "zstd:1,group_size:2", [-1_000, 1_000, 0, 0, 40]),
    ("g1_empty", "group_size:1", []),  # no record chunk at all
]


def _records(rng: random.Random, sizes: list[int]) -> list[bytes]:
  words = [b"grain", b"elevator", b"shard", b"record", b"chunk", b" ", b"\n"]
  out = []
  for s in sizes:
    if s >= 0:
      out.append(rng.randbytes(s))
    else:
      text = b"".join(rng.choice(words) for _ in range(-s))
      out.append(text[:-s])
  return out


def build(directory: str, seed: int = 0) -> list[str]:
  """Writes the seed shards into `directory`; returns their paths."""
  rng = random.Random(seed)
  paths = []
  for name, options, sizes in SEEDS:
    path = os.path.join(directory, f"{name}.array_record")
    writer = ArrayRecordWriter(path, options)
    for record in _records(rng, sizes):
      writer.write(record)
    writer.close()
    paths.append(path)
  return paths
