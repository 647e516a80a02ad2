"""Fuzzes server/data/shards/reader.py (and server/data/shards/riegeli.c, built with ASan and
UBSan) against ArrayRecord's own reader.

    python tests/fuzz/fuzz_reader.py --seconds 60 --seed 1 --out fuzz-findings
    python tests/fuzz/fuzz_reader.py --replay fuzz-findings/0001-differ.array_record

Why: the shard reader parses files that may come from anyone who can write
to a dataset bucket, in C, on every worker. For each mutant of a real shard
(tests/fuzz/mutate.py; many re-signed so that every hash checks) our reader
must either refuse it (CorruptShard, or UnsupportedShard where ArrayRecord
takes over) or return exactly the bytes ArrayRecord returns; where
ArrayRecord refuses a record, ours must too. Anything else is a finding:
another exception, a sanitizer report or crash, an input that takes longer
than --timeout, different bytes, or a refusal that does not name the shard
and the chunk. Findings are saved under --out with what made them; the run
exits 1 if there were any, 77 if the sanitizer build is not possible here
(no gcc or libasan) unless --no-sanitizer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCE = os.path.join(ROOT, "server", "data", "shards", "riegeli.c")
SKIP = 77  # "cannot run here", as automake's test drivers read it

sys.path.insert(0, HERE)
import corpus  # pylint: disable=g-import-not-at-top,wrong-import-position
import mutate  # pylint: disable=g-import-not-at-top,wrong-import-position


class CannotRun(Exception):
  """The sanitizer build is not possible on this machine."""


def build_sanitized(directory: str) -> tuple[str, str]:
  """server/data/shards/riegeli.c as an extension module with ASan and UBSan; returns
  (module path, libasan path to preload)."""
  gcc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("gcc")
  if not gcc:
    raise CannotRun("no gcc on PATH")
  libasan = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True,
                           text=True, check=False).stdout.strip()
  if not os.path.isabs(libasan) or not os.path.exists(libasan):
    raise CannotRun(f"gcc has no libasan ({gcc} -print-file-name=libasan.so: {libasan!r})")
  include = sysconfig.get_paths()["include"]
  if not os.path.exists(os.path.join(include, "Python.h")):
    raise CannotRun(f"no Python.h in {include}")
  out = os.path.join(directory, "_riegeli" + sysconfig.get_config_var("EXT_SUFFIX"))
  cmd = [gcc, "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address,undefined",
         "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-I", include, SOURCE,
         "-o", out]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if done.returncode:
    if "asan" in done.stderr or "ubsan" in done.stderr:
      raise CannotRun(f"gcc cannot link the sanitizers: {done.stderr[-500:]}")
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
  return out, libasan


def sanitizer_env(libasan: str) -> dict[str, str]:
  env = dict(os.environ)
  env["LD_PRELOAD"] = libasan
  # Leaks: Python's own allocations at exit are not ours. A size the reader
  # believes from a file would make ASan abort; returning NULL instead turns
  # it into a MemoryError the comparison reports as a finding.
  env["ASAN_OPTIONS"] = ("detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:"
                         "allocator_may_return_null=1:max_allocation_size_mb=4096:"
                         "detect_stack_use_after_return=1:strict_string_checks=1:"
                         "handle_abort=1:print_summary=1")
  env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=87"
  return env


class Worker:
  """A reading process (tests/fuzz/worker.py) that answers one job at a time."""

  def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str):
    self.name, self.argv, self.env, self.log_dir = name, argv, env, log_dir
    self.proc: subprocess.Popen | None = None
    self.starts = 0
    self.hello: dict = {}

  def start(self) -> None:
    self.starts += 1
    self.log = os.path.join(self.log_dir, f"{self.name}-{self.starts}.log")
    self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), *self.argv],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(self.log, "w"), env=self.env, text=True, bufsize=1,
                                 cwd=ROOT)
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"{self.name} did not start:\n{self.stderr()}")
    self.hello = json.loads(line)

  def stderr(self) -> str:
    with open(self.log, errors="replace") as f:
      return f.read()[-20_000:]

  def send(self, job: dict) -> None:
    if self.proc is None or self.proc.poll() is not None:
      self.start()
    self.proc.stdin.write(json.dumps(job) + "\n")
    self.proc.stdin.flush()

  def receive(self, timeout: float) -> tuple[str, Any]:
    """("ok", result), ("hang", seconds) or ("died", (exit status, stderr))."""
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
    if not ready:
      self.stop()
      return "hang", timeout
    line = self.proc.stdout.readline()
    if not line:
      status = self.proc.wait()
      out = ("died", (status, self.stderr()))
      self.proc = None
      return out
    return "ok", json.loads(line)

  def stop(self) -> None:
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait()
      self.proc = None


# Where ours refuses, the message must name the shard and the chunk (the
# server passes it on to the client as DATA_LOSS).
_NAMES_CHUNK = re.compile(r"chunk at byte \d+|bytes is less than ArrayRecord's")


def stricter(ours: dict, ar: dict | None) -> list[str]:
  """Our refusals of what ArrayRecord reads: allowed (DATA_LOSS for a shard
  ArrayRecord would serve), but counted, to see that they are rare and why."""
  if ar is None or ar["open"] != "ok":
    return []
  if ours["open"] == "corrupt":
    return [ours["message"]] if not ar["errors"] else []
  out = []
  for read in ours.get("reads", []):
    if "corrupt" in read and not any(str(i) in ar["errors"] for i in read["idx"]):
      out.append(read["corrupt"])
  return out


def compare(ours: dict, ar: dict | None, path: str) -> list[str]:
  """What is wrong with our reader's result, given ArrayRecord's (None: it
  crashed or hung, i.e. refused the file)."""
  problems: list[str] = []

  def check_message(message: str) -> None:
    if path not in message or not _NAMES_CHUNK.search(message):
      problems.append(f"refusal does not name the shard and chunk: {message!r}")

  if ours["open"] == "error":
    return [f"open raised {ours['message']}"]
  if ours["open"] == "corrupt":
    check_message(ours["message"])
    return problems
  if ours["open"] == "unsupported":
    return problems
  ar_ok = ar is not None and ar["open"] == "ok"
  if ar_ok and ar["n"] != ours["n"]:
    problems.append(f"{ours['n']} records, ArrayRecord says {ar['n']}")
    return problems
  for read in ours["reads"]:
    idx = read["idx"]
    if "error" in read:
      problems.append(f"read {idx[:8]} raised {read['error']}")
    elif "unsupported" in read:
      break  # the server reads the shard through ArrayRecord from here on
    elif "corrupt" in read:
      check_message(read["corrupt"])
    elif not ar_ok:
      problems.append(f"read {idx[:8]} returned records; ArrayRecord refuses the file: "
                      f"{(ar or {}).get('message', 'it crashed or hung')}")
    else:
      for i, got in zip(idx, read["ok"]):
        if str(i) in ar["errors"]:
          problems.append(f"record {i} returned; ArrayRecord refuses it: {ar['errors'][str(i)]}")
          break
        if ar["records"].get(str(i)) != got:
          problems.append(f"record {i} differs from ArrayRecord's")
          break
    if len(problems) > 3:
      break
  return problems


def signature(problems: list[str]) -> str:
  """A finding's kind, for counting repeats: its first problem without numbers."""
  return re.sub(r"\d+", "N", problems[0].split(":")[0])[:80]


class Fuzzer:
  """Mutates seeds, runs both readers, compares, keeps findings."""

  def __init__(self, args: argparse.Namespace, work: str):
    self.args, self.work = args, work
    self.out = os.path.abspath(args.out)
    os.makedirs(self.out, exist_ok=True)
    module, env = None, dict(os.environ)
    if not args.no_sanitizer:
      module, libasan = build_sanitized(work)
      env = sanitizer_env(libasan)
    self.ours = Worker("ours", ["ours", module] if module else ["ours"], env, work)
    self.ar = Worker("arrayrecord", ["arrayrecord"], dict(os.environ), work)
    self.findings = 0
    self.kinds: collections.Counter = collections.Counter()
    self.stats: collections.Counter = collections.Counter()
    self.strict: collections.Counter = collections.Counter()
    from grain_elevator.server.data.shards import _riegeli  # pylint: disable=g-import-not-at-top
    self.hash = _riegeli.hash

  def start(self) -> None:
    self.ours.start()
    self.ar.start()
    print(f"fuzz: ours: {self.ours.hello}", flush=True)
    if not self.args.no_sanitizer and not self.ours.hello.get("asan"):
      raise RuntimeError("the sanitizer runtime is not loaded in the worker")

  def check(self, data: bytes, seed: int) -> list[str]:
    """Runs both readers on `data`; returns the problems (empty: fine)."""
    path = os.path.join(self.work, "input.array_record")
    with open(path, "wb") as f:
      f.write(data)
    job = {"path": path, "seed": seed}
    self.ours.send(job)
    self.ar.send(job)
    ar_kind, ar = self.ar.receive(max(self.args.timeout, 60))
    kind, ours = self.ours.receive(self.args.timeout)
    self.stats[f"arrayrecord {ar_kind}"] += 1
    if ar_kind != "ok":
      ar = None
    elif ar["open"] != "ok":
      self.stats["arrayrecord refuses the file"] += 1
    if kind == "hang":
      return [f"hang: no answer in {self.args.timeout} s"]
    if kind == "died":
      status, log = ours
      return [f"crashed (exit status {status})", log[-6000:]]
    self.stats[f"ours open {ours['open']}"] += 1
    for read in ours.get("reads", []):
      self.stats["ours read " + next(k for k in ("ok", "corrupt", "unsupported", "error")
                                     if k in read)] += 1
    for message in stricter(ours, ar)[:1]:
      why = re.sub(r"\d+", "N", message.replace(path, "").split(": ", 2)[-1])[:90]
      self.strict[why] += 1
    return compare(ours, ar, path)

  def save(self, data: bytes, problems: list[str], steps: list[str], seed: int,
           origin: str) -> None:
    self.findings += 1
    kind = signature(problems)
    self.kinds[kind] += 1
    print(f"FINDING {self.findings} ({origin}): {problems[0]}", flush=True)
    for s in steps:
      print(f"    {s}", flush=True)
    if self.kinds[kind] > self.args.keep:
      return
    name = os.path.join(self.out, f"{self.findings:04d}-{re.sub(r'[^a-z]+', '-', kind.lower())[:40]}")
    with open(name + ".array_record", "wb") as f:
      f.write(data)
    with open(name + ".txt", "w") as f:
      f.write(f"seed shard: {origin}\nread seed: {seed}\n\nsteps:\n")
      f.writelines(f"  {s}\n" for s in steps)
      f.write("\nproblems:\n")
      f.writelines(f"  {p}\n" for p in problems)
    print(f"    saved {name}.array_record", flush=True)

  def run(self) -> int:
    corpus_dir = os.path.join(self.work, "corpus")
    os.makedirs(corpus_dir)
    seeds = corpus.build(corpus_dir)
    blobs = [(os.path.basename(p), open(p, "rb").read()) for p in seeds]
    master = random.Random(self.args.seed)
    print(f"fuzz: seed {self.args.seed}, {len(blobs)} seed shards, {self.args.seconds} s, "
          f"findings to {self.out}", flush=True)
    self.start()
    start = last = time.monotonic()
    count = 0
    # The seeds themselves first: both readers must agree on valid shards.
    queue = [(name, blob, [], 0) for name, blob in blobs]
    while True:
      now = time.monotonic()
      if now - start >= self.args.seconds and not queue:
        break
      if queue:
        name, data, steps, seed = queue.pop()
      else:
        seed = master.getrandbits(63)
        rng = random.Random(seed)
        name, blob = rng.choice(blobs)
        try:
          data, steps = mutate.mutate(rng, blob, self.hash)
        except Exception as e:  # pylint: disable=broad-except
          raise RuntimeError(f"the mutator failed on seed {seed} ({name})") from e
      problems = self.check(data, seed)
      count += 1
      if problems:
        self.save(data, problems, steps, seed, name)
      if now - last >= self.args.progress:
        last = now
        print(f"fuzz: {now - start:6.0f} s  {count} inputs ({count / (now - start):.1f}/s)  "
              f"{self.findings} findings", flush=True)
    self.ours.stop()
    self.ar.stop()
    print(f"fuzz: outcomes: {dict(sorted(self.stats.items()))}")
    for why, n in self.strict.most_common(12):
      print(f"fuzz: {n:6d} inputs refused where ArrayRecord reads them: {why}")
    for kind, n in self.kinds.most_common():
      print(f"fuzz: {n:6d} x {kind}")
    print(f"fuzz: {count} inputs in {time.monotonic() - start:.0f} s, {self.findings} findings",
          flush=True)
    return 1 if self.findings else 0

  def replay(self, path: str, seed: int) -> int:
    self.start()
    data = open(path, "rb").read()
    problems = self.check(data, seed)
    job = {"path": os.path.join(self.work, "input.array_record"), "seed": seed}
    for w in (self.ours, self.ar):
      w.send(job)
      print(f"{w.name}: {json.dumps(w.receive(self.args.timeout)[1])[:3000]}")
    print("problems:" if problems else "no problems", *problems, sep="\n  ")
    self.ours.stop()
    self.ar.stop()
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seconds", type=float, default=60, help="how long to fuzz")
  parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
  parser.add_argument("--out", default="fuzz-findings", help="folder for findings")
  parser.add_argument("--timeout", type=float, default=20,
                      help="seconds one input may take our reader (else: a hang)")
  parser.add_argument("--keep", type=int, default=3, help="inputs saved per kind of finding")
  parser.add_argument("--progress", type=float, default=10, help="seconds between reports")
  parser.add_argument("--no-sanitizer", action="store_true",
                      help="use the installed extension (no gcc needed; finds less)")
  parser.add_argument("--replay", help="check one saved input and print both readers' results")
  parser.add_argument("--read-seed", type=int, default=0, help="with --replay: the read seed")
  args = parser.parse_args(argv)
  if args.seed is None:
    args.seed = int(time.time())
  with tempfile.TemporaryDirectory(prefix="fuzz-reader-") as work:
    try:
      fuzzer = Fuzzer(args, work)
    except CannotRun as e:
      print(f"fuzz: cannot build the sanitizer module: {e}", file=sys.stderr)
      return SKIP
    if args.replay:
      return fuzzer.replay(args.replay, args.read_seed)
    return fuzzer.run()


if __name__ == "__main__":
  sys.exit(main())
