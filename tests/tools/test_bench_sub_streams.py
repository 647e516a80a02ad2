"""The sub-streams bench (tools/bench/sub_streams.py) at tiny sizes: its
table has every row, and the tokens a run counted are the text tokens a
reader of the same steps receives (no figure of speed is checked)."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset
from grain_elevator.tools.bench import sub_streams

pytestmark = pytest.mark.slow

SHARDS = 4


def _text_tokens(targets: list[str], run: sub_streams.Run) -> int:
  """Token ids (never 0; padding is) in the run's steps, read anew."""
  with RemoteDataset(targets, run.dataset, sub_streams.GLOBAL_BATCH) as ds:
    it = iter(ds)
    batches = [next(it) for _ in range(run.first_step + run.steps)]
  return sum(int(np.count_nonzero(b["tokens"])) for b in batches[run.first_step:])


def test_every_row_is_measured_and_counts_the_tokens_delivered(serve, tmp_path):
  sub_streams.write_records(tmp_path, records=256)
  config = sub_streams.write_config(tmp_path, shard_counts=[1, SHARDS], runs=1, sleep_ms=0.1)
  targets = [serve(config, workers=1).target, serve(config, workers=2).target]
  rows = sub_streams.rounds(targets, sub_streams.rows_for([1, 2], SHARDS), rounds_=1,
                            steps=3, warmup_steps=2, warmup_s=0.0, sleep_ms=0.1,
                            settle=False)
  table = sub_streams.table(rows, workers=1, sleep_ms=0.1).splitlines()
  labels = [line.split("|")[1].strip() for line in table[2:]]
  assert labels == ["N=4, 1 server", "N=4, 2 servers", "N=1, 1 server (one stream)",
                    "N=1, 2 servers (replicas: failover)"]
  assert table[2].split("|")[5].strip() == "1.00"  # the ratios' base
  for row in rows:
    (run,) = row.runs
    assert (run.first_step, run.steps) == (2, 3)
    assert run.tokens > 0
    assert run.tokens == _text_tokens(targets[:row.servers], run), row.label
