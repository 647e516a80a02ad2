"""Sub-streams (issue #46): a stream's tokens/s from 1, 2 and 4 servers.

  python -m grain_elevator.tools.bench.sub_streams [--servers 1,2,4] [--shards 4]
      [--workers 2] [--sleep-ms 10] [--steps 200] [--rounds 3]

A stream dataset with `stream_shards = N` is N pipelines, each owned by a
worker its client routes it to, so N sub-streams keep up to N servers busy
(server/data/streams/sub_streams.py). This measures what a DEFAULT
`RemoteDataset` (no transport or window option) reads of such a stream, in
tokens/s, from 1, 2 and 4 `elevator serve` processes on 127.0.0.1 given as
replicas, each with W workers.

The head is a costly one, emulated: records are pre-tokenized int32 arrays
of varied lengths, and the head holds its worker SLEEP per record (one
record at a time per worker process, as tools/bench/sleeping.py's workers
do), so 4 servers x W workers are busy on this 2-core machine without
taking its cores. Then `chunk_and_pack` (pipelines/text.py) into rows of
LENGTH tokens and `batch_and_pad`. At the default sizes the CPU that is not
sleep (packing, serving, the client) is a few per cent of what the sleeps
hold, so the figures show how the head scales. Tokens are the text tokens
delivered: the non-zero segment ids.

Rows: N sub-streams from each number of servers (the ratio is to one
server); the same data as one stream (N=1) on one server, the reference;
and N=1 on the most servers, where a second replica adds failover, not
throughput (~1x). Rows are measured in turn, round after round
(tools/bench/harness.py's interleaving), each run reading a dataset of its
own (its own seed: no server reuses steps it made for an earlier run),
after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import numpy as np
import psutil

LENGTH = 512  # tokens per packed row, and at most per chunk
PACKING_BINS = 8
GLOBAL_BATCH = 16  # rows a step: G/N = 4 rows a sub-batch at N=4
MIN_TOKENS, MAX_TOKENS = 64, 1024  # a record's tokens, uniform: ~1 row a record
VOCAB = 32_000
RECORDS, SHARDS = 4096, 4  # ~9 MB of records, repeated
SEGMENT_IDS = "tokens_segment_ids"  # chunk_and_pack's; 0 is padding
DATASET = "sub"
MODULE = "grain_elevator.tools.bench.sub_streams"

# A worker process has one core: its records wait in turn (sleeping.py's _CORE).
_CORE = threading.Lock()


# -- the server's pipeline ------------------------------------------------------

def _tokens(record: bytes, *, seconds: float) -> dict[str, np.ndarray]:
  with _CORE:
    time.sleep(seconds)
  return {"tokens": np.frombuffer(record, dtype="<i4")}


def tokens(ds: Any, *, sleep_us_per_record: float) -> Any:
  """Records of little-endian int32 tokens -> {"tokens": int32[n]}, each
  holding its worker `sleep_us_per_record` (a tokenizer's cost, emulated)."""
  return ds.map(functools.partial(_tokens, seconds=sleep_us_per_record / 1e6))


# -- data and config -------------------------------------------------------------

def write_records(root: pathlib.Path, records: int = RECORDS) -> pathlib.Path:
  """root/tokens/*.array_record: `records` token arrays of MIN_TOKENS to
  MAX_TOKENS tokens (written once per root and count)."""
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  out = root / "tokens"
  marker = out / f".complete-{records}"
  if not marker.exists():
    rng = np.random.default_rng(0)
    lengths = rng.integers(MIN_TOKENS, MAX_TOKENS + 1, size=records)
    examples.write_shards(str(out), records, lambda i: rng.integers(
        1, VOCAB, size=lengths[i], dtype="<i4").tobytes(), num_shards=SHARDS)
    marker.touch()
  return out


def dataset_name(shards: int, run: int) -> str:
  """The dataset one run reads: its own seed, so no server has its steps."""
  return f"{DATASET}_n{shards}_r{run}"


def write_config(root: pathlib.Path, *, shard_counts: Sequence[int], runs: int,
                 sleep_ms: float) -> pathlib.Path:
  """root/sub-streams.toml: for each N in `shard_counts`, `runs` datasets
  over root/tokens (dataset_name(N, r), seed r)."""
  lines = []
  for n in shard_counts:
    for r in range(runs):
      name = dataset_name(n, r)
      lines += [f"[datasets.{name}]", 'paths = ["tokens/*.array_record"]',
                f'pipeline = "{MODULE}:tokens"',
                'iter_pipeline = "grain_elevator.pipelines.text:chunk_and_pack"',
                'batch_fn = "grain.experimental:batch_and_pad"',
                f"seed = {r + 1}", "num_epochs = 0", f"stream_shards = {n}",
                f"[datasets.{name}.options]", f"sleep_us_per_record = {sleep_ms * 1e3:g}",
                f"[datasets.{name}.iter_options]", f"length = {LENGTH}",
                f"num_packing_bins = {PACKING_BINS}", ""]
  path = root / "sub-streams.toml"
  path.write_text("\n".join(lines))
  return path


# -- one run -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
  """One timed read: steps [first_step, first_step + steps) of `dataset`."""

  dataset: str
  first_step: int
  steps: int
  tokens: int  # non-zero segment ids in those steps
  seconds: float
  server_cores: float  # CPU seconds of the servers' processes per second
  client_cores: float  # of this process
  machine_busy: float  # share of the machine's CPUs busy, [0, 1]
  wait_ratio: float  # share of the client's time in next() (its Stats)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds


def _cpu_s(procs: list[psutil.Process]) -> float:
  total = 0.0
  for p in procs:
    try:
      t = p.cpu_times()
      total += t.user + t.system
    except psutil.Error:  # a worker restarted: its time is lost, not an error
      pass
  return total


def _processes(pids: Sequence[int]) -> list[psutil.Process]:
  """The servers' supervisors and their workers."""
  out = []
  for pid in pids:
    p = psutil.Process(pid)
    out += [p, *p.children(recursive=True)]
  return out


def segment_tokens(batch: dict[str, np.ndarray]) -> int:
  """Text tokens in a batch of chunk_and_pack's rows (padding is segment 0)."""
  return int(np.count_nonzero(batch[SEGMENT_IDS]))


def measure(targets: Sequence[str], dataset: str, *, steps: int, warmup_steps: int = 2,
            warmup_s: float = 0.0, server_pids: Sequence[int] = (),
            global_batch_size: int = GLOBAL_BATCH) -> Run:
  """A default RemoteDataset over `targets` (replicas): at least
  `warmup_steps` steps and `warmup_s` seconds untimed (sessions open,
  the heads fill), then `steps` steps timed."""
  from grain_elevator.client import RemoteDataset  # pylint: disable=g-import-not-at-top
  servers = _processes(server_pids)
  me = psutil.Process()
  with RemoteDataset(list(targets), dataset, global_batch_size) as ds:
    it = iter(ds)
    first, start = 0, time.monotonic()
    while first < warmup_steps or time.monotonic() - start < warmup_s:
      next(it)
      first += 1
    waited = ds.stats()
    psutil.cpu_percent()  # from here
    server_cpu, client_cpu = _cpu_s(servers), _cpu_s([me])
    count, start = 0, time.perf_counter()
    for _ in range(steps):
      count += segment_tokens(next(it))
    seconds = time.perf_counter() - start
    busy = psutil.cpu_percent() / 100
    server_cpu, client_cpu = _cpu_s(servers) - server_cpu, _cpu_s([me]) - client_cpu
    wait = ds.stats().wait_s - waited.wait_s
  return Run(dataset, first, steps, count, seconds, server_cpu / seconds,
             client_cpu / seconds, busy, min(1.0, wait / seconds))


# -- rounds and the table ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
  """A configuration measured: N sub-streams from the first `servers` servers."""

  label: str
  servers: int
  shards: int
  runs: list[Run] = dataclasses.field(default_factory=list)

  def median(self, figure: str) -> float:
    return statistics.median(getattr(r, figure) for r in self.runs)


def rows_for(server_counts: Sequence[int], shards: int) -> list[Row]:
  """The rows a bench of these servers and N measures, in table order."""
  most = max(server_counts)
  out = [Row(f"N={shards}, {s} server{'s' if s > 1 else ''}", s, shards)
         for s in server_counts]
  if shards == 1:  # those rows are the references already
    return out
  out.append(Row("N=1, 1 server (one stream)", 1, 1))
  if most > 1:
    out.append(Row(f"N=1, {most} servers (replicas: failover)", most, 1))
  return out


def settle_s(row: Row, sleep_ms: float) -> float:
  """How long the servers may go on with a run's head after its client
  left, to be charged to no other run: each owner of a server keeps
  TASKS_AHEAD_PER_WORKER x W tasks of TASK_ELEMENTS records dealt
  (server/data/streams/parallel_head.py), which its W workers make at a
  sleep a record."""
  from grain_elevator.server.data.streams import parallel_head  # pylint: disable=g-import-not-at-top
  owners = -(-row.shards // row.servers)
  return (owners * parallel_head.TASKS_AHEAD_PER_WORKER * parallel_head.TASK_ELEMENTS
          * sleep_ms / 1e3)


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def rounds(targets: Sequence[str], rows: list[Row], *, rounds_: int, steps: int,
           warmup_steps: int, warmup_s: float, sleep_ms: float,
           server_pids: Sequence[int] = (), settle: bool = True) -> list[Row]:
  """Each row once a round, in turn, `rounds_` rounds: a row reads from the
  first `row.servers` of `targets` (servers whose supervisors are
  `server_pids`, if given, for their CPU); run r reads dataset_name(N, r)."""
  for r in range(rounds_):
    for row in rows:
      run = measure(targets[:row.servers], dataset_name(row.shards, r), steps=steps,
                    warmup_steps=warmup_steps, warmup_s=warmup_s,
                    server_pids=server_pids[:row.servers])
      row.runs.append(run)
      log(f"[sub_streams] round {r + 1}/{rounds_} {row.label:<34} "
          f"{run.tokens_per_s:>10,.0f} tokens/s  servers {run.server_cores:.2f} cores, "
          f"client {run.client_cores:.2f}, machine {run.machine_busy:.0%} busy, "
          f"waited {run.wait_ratio:.0%}")
      if settle:
        time.sleep(settle_s(row, sleep_ms))
  return rows


def _fmt(values: list[float], digits: int = 0) -> str:
  f = f"{{:,.{digits}f}}"
  return (f"{f.format(statistics.median(values))} ({f.format(min(values))}–"
          f"{f.format(max(values))})")


def bound(row: Row, workers: int, sleep_ms: float) -> float:
  """The tokens/s the sleeps allow: the heads of min(N, servers) servers
  (a sub-stream's head runs on its owner's server), each W records a
  sleep, of (MIN_TOKENS + MAX_TOKENS) / 2 tokens on average."""
  return (min(row.shards, row.servers) * workers * 1e3 / sleep_ms
          * (MIN_TOKENS + MAX_TOKENS) / 2)


def table(rows: list[Row], *, workers: int, sleep_ms: float) -> str:
  """Markdown: per row, tokens/s median (min–max), its ratio to the N
  sub-streams on one server and to what the sleeps allow, and where the
  CPU went (medians)."""
  base = next((r for r in rows if r.servers == 1 and r.shards > 1), rows[0])
  lines = ["| system | servers | stream_shards | tokens/s | × 1 server | of the sleeps' bound "
           "| server CPU cores | client CPU cores | machine busy |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    tokens_per_s = row.median("tokens_per_s")
    lines.append(
        f"| {row.label} | {row.servers} | {row.shards} | "
        f"{_fmt([r.tokens_per_s for r in row.runs])} | "
        f"{tokens_per_s / base.median('tokens_per_s'):.2f} | "
        f"{tokens_per_s / bound(row, workers, sleep_ms):.0%} | "
        f"{row.median('server_cores'):.2f} | {row.median('client_cores'):.2f} | "
        f"{row.median('machine_busy'):.0%} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
  parser.add_argument("--servers", default="1,2,4", help="server counts, comma-separated")
  parser.add_argument("--shards", type=int, default=4, help="stream_shards (N)")
  parser.add_argument("--workers", type=int, default=2, help="workers per server (W)")
  parser.add_argument("--sleep-ms", type=float, default=10.0, help="the head's per record")
  parser.add_argument("--steps", type=int, default=200, help="steps timed per run")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup-s", type=float, default=3.0, help="untimed, per run")
  parser.add_argument("--data", default=None, help="folder (default: a temp folder)")
  args = parser.parse_args(argv)
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  counts = sorted({int(c) for c in args.servers.split(",")})
  root = pathlib.Path(args.data or tempfile.mkdtemp(prefix="elevator-sub-streams-"))
  write_records(root)
  rows = rows_for(counts, args.shards)
  config = write_config(root, shard_counts=sorted({1, args.shards}), runs=args.rounds + 1,
                        sleep_ms=args.sleep_ms)
  servers: list[Any] = []
  try:
    for _ in range(max(counts)):  # from this thread, which outlives them (launcher.py)
      servers.append(LocalServer(str(config), workers=args.workers))
    log(f"[sub_streams] {len(servers)} servers of W={args.workers} up; warming up")
    # Imports and first sessions on every server, untimed: the last run's datasets.
    for n in sorted({1, args.shards}):
      measure([s.target for s in servers], dataset_name(n, args.rounds), steps=0,
              warmup_steps=8)
    rounds([s.target for s in servers], rows, rounds_=args.rounds, steps=args.steps,
           warmup_steps=8, warmup_s=args.warmup_s, sleep_ms=args.sleep_ms,
           server_pids=[s.proc.pid for s in servers])
  finally:
    for s in servers:
      s.stop()
  print(f"### A stream's head over servers: tokens/s of a default RemoteDataset, "
        f"W={args.workers} workers a server, head {args.sleep_ms:g} ms a record (slept), "
        f"rows of {LENGTH} tokens, G={GLOBAL_BATCH}; median (min–max) of {args.rounds} "
        f"rounds of {args.steps} steps\n")
  print(table(rows, workers=args.workers, sleep_ms=args.sleep_ms))


if __name__ == "__main__":
  main()
