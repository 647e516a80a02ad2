"""Fuzzes the positions that stream requests carry, against a live server.

    python tests/fuzz/fuzz_positions.py --seconds 60 --seed 1 --out fuzz-findings

Why: every request for a stream dataset names where its first step starts
(stream_state, a Grain iterator's state as JSON), and a worker takes it from
any client: a stale cursor retried in a loop, a bug, an attacker. Positions
are mutated from real ones of three stream shapes (a filter, a flat_map in
evaluation mode, tokenize-chunk-pack), in structure (keys added, dropped or
renamed; values of other types, negative, huge, nested; another stream's
position) and in text (cut, spliced, stray bytes, very long), then sent with
random G, host slices and step counts over gRPC to a live 2-worker server.
Each answer must be

  * batches, from a position Grain's own pipeline (built here, in this
    process) restores and reads back as itself, equal to embedded mode's
    answer to the same request, or
  * INVALID_ARGUMENT (not a position of the stream), OUT_OF_RANGE (past a
    finite stream's end) or DATA_LOSS (a position Grain took whose pipeline
    cannot go on: the shape and the read-back cannot see everything);

and every --check-every inputs the server must answer health SERVING, serve
each unmutated stream exactly, have restarted no worker, and hold its
sessions within MAX_STREAM_SESSIONS and its workers' RSS within --rss-mb of
what they held after warming up. Findings are printed and saved under --out
(positions-*.json); the run exits 1 if there were any.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import sys
import tempfile
import time
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/
# pylint: disable=g-import-not-at-top,wrong-import-position
import datasets  # the one builder of the tests' dataset configs (tests/datasets.py)
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.pipelines import examples
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.server import Server, ServerOptions
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import registry
from grain_elevator.server.data import grain_private
from grain_elevator.server.serving.stream_sessions import MAX_STREAM_SESSIONS
from grain_elevator.tools import text_corpus
from grain_elevator.tools import tokenizer as tokenizer_lib
from grain_elevator.tools import top

CONFIG = datasets.config_text(
    # a filter, 2 epochs
    few=datasets.images(pipeline=datasets.DECODE_SOME, seed=21, num_epochs=2,
                        options={"labels": [1, 3, 7]}),
    # a flat_map, evaluation mode
    rows=datasets.images(pipeline="grain_elevator.pipelines.examples:decode_rows", seed=22,
                         drop_remainder=False),
    # tokenize, chunk, first-fit packing
    lm=datasets.packed_text(seed=23, num_epochs=0, length=32, bins=8))
DATASETS = ("few", "rows", "lm")
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.DATA_LOSS}
_REQUEST_TIMEOUT_S = 60.0

Json = Any


def _write_data(root: pathlib.Path) -> None:
  examples.write_image_shards(str(root / "shards"), num_records=1000, num_shards=2,
                              height=4, width=4, channels=3)
  text_corpus.write_jsonl_shards(str(root / "text"), 120, num_shards=2, seed=3)
  tokenizer_lib.train(root / "tokenizer.json", vocab_size=512)
  (root / "elevator.toml").write_text(CONFIG)


# -- mutations -------------------------------------------------------------------

def _paths(value: Json, at: tuple = ()) -> list[tuple]:
  """Every place in a JSON value, as key/index paths."""
  out = [at]
  if isinstance(value, dict):
    for k, v in value.items():
      out += _paths(v, at + (k,))
  elif isinstance(value, list):
    for i, v in enumerate(value):
      out += _paths(v, at + (i,))
  return out


def _replace(value: Json, at: tuple, new: Json) -> Json:
  if not at:
    return new
  copy = dict(value) if isinstance(value, dict) else list(value)
  copy[at[0]] = _replace(value[at[0]], at[1:], new)
  return copy


def _get(value: Json, at: tuple) -> Json:
  for k in at:
    value = value[k]
  return value


def _odd_value(rng: random.Random, old: Json) -> Json:
  base = old if isinstance(old, int) and not isinstance(old, bool) else 0
  return rng.choice([
      -1, -base - 1, base + 1, base + rng.randint(2, 10**6), base * 1000 + 7, 2**31, 2**63 - 1,
      2**63, 10**30, -(2**63), 0.5, float(base), "1", "", "x" * rng.randint(1, 5000), None,
      True, False, [], [base], {}, {"next_index": base}, [[[[]]]]])


def _structural(rng: random.Random, state: Json, others: list[Json]) -> Json:
  places = _paths(state)
  at = rng.choice(places)
  kind = rng.randrange(7)
  if kind == 0:  # a value of another kind or size
    return _replace(state, at, _odd_value(rng, _get(state, at)))
  if kind == 1:  # a key more
    target = _get(state, at[:-1]) if at else state
    if isinstance(target, dict):
      return _replace(state, at[:-1] if at else (), {**target, rng.choice(
          ["parent", "next_index", "evil", "__proto__", "", "counter"]) + "_": 1})
  if kind == 2 and at:  # a key less
    parent = _get(state, at[:-1])
    if isinstance(parent, dict):
      return _replace(state, at[:-1], {k: v for k, v in parent.items() if k != at[-1]})
  if kind == 3:  # another stream's position, whole or in part
    other = rng.choice(others)
    return other if rng.random() < 0.5 else _replace(state, at,
                                                    _get(other, rng.choice(_paths(other))))
  if kind == 4:  # deep nesting
    nested: Json = 0
    for _ in range(rng.randint(10, 400)):
      nested = {"parent": nested}
    return _replace(state, at, nested)
  if kind == 5:  # every whole number moved
    delta = rng.choice([-1, 1, 1000, -1000])
    out = state
    for place in _paths(state):
      value = _get(state, place)
      if isinstance(value, int) and not isinstance(value, bool):
        out = _replace(out, place, value + delta)
    return out
  return _replace(state, at, _odd_value(rng, _get(state, at)))


def _textual(rng: random.Random, text: str) -> str:
  kind = rng.randrange(6)
  if kind == 0:
    return text[:rng.randrange(len(text) + 1)]
  if kind == 1:
    i = rng.randrange(len(text) + 1)
    return text[:i] + rng.choice(['"', "{", "}", ",", ":", "\\", "\x00", "é", "1e999",
                                  "NaN", "]", "  "]) + text[i:]
  if kind == 2:  # a key twice: JSON keeps the last
    return text[:-1] + ',"next_index":0}' if text.endswith("}") else text
  if kind == 3:
    return text + " " * rng.randint(1, 20000)
  if kind == 4:
    return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randint(0, 200)))
  return text.replace("0", str(rng.randint(0, 9)), rng.randint(1, 3))


def mutate(rng: random.Random, text: str, others: list[str]) -> str:
  if rng.random() < 0.7:
    state = json.loads(text)
    for _ in range(rng.randint(1, 3)):
      state = _structural(rng, state, [json.loads(o) for o in others])
    return json.dumps(state)
  return _textual(rng, text)


# -- the run ---------------------------------------------------------------------

class Run:
  """A live server, its oracle and the checks between inputs."""

  def __init__(self, root: pathlib.Path, args: argparse.Namespace):
    self.args = args
    self.config = str(root / "elevator.toml")
    self.server = Server(self.config, ServerOptions(port=0, workers=2, metrics_port=0))
    self.server.start()
    self.target = f"127.0.0.1:{self.server.port}"
    self.channel = grpc.insecure_channel(self.target)
    self.stub = pb_grpc.ElevatorStub(self.channel)
    self.health = health_pb2_grpc.HealthStub(self.channel)
    self.oracle = EmbeddedBackend(self.config)
    self.datasets = registry.Datasets(config_lib.load_config(self.config))
    self.positions: dict[str, list[str]] = {}
    self.fingerprints: dict[str, str] = {}
    for name in DATASETS:
      (info,) = self.stub.Describe(pb.DescribeRequest(dataset=name), timeout=60).datasets
      self.fingerprints[name] = info.config_fingerprint
      got = self.oracle.fetch(pb.BatchRequest(dataset=name, global_batch_size=4,
                                              shard_count=1, num_steps=25))
      self.positions[name] = [info.stream_start] + [s.next_stream_state for s in got]
    self.check()
    self.rest_rss = self._rss()

  def _rss(self) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in self.server.worker_pids())

  def ask(self, request: pb.BatchRequest) -> tuple[str, Any]:
    try:
      return "ok", list(self.stub.GetBatches(request, timeout=_REQUEST_TIMEOUT_S))
    except grpc.RpcError as e:
      return e.code().name, e.details()

  def one(self, rng: random.Random) -> tuple[pb.BatchRequest, str, str | None]:
    """One mutated request: (the request, what came back, why it is a
    finding or None)."""
    name = rng.choice(DATASETS)
    others = [p for n, ps in self.positions.items() if n != name for p in ps[:3]]
    state = mutate(rng, rng.choice(self.positions[name]), others)
    h_count = rng.choice([1, 1, 2, 4])
    request = pb.BatchRequest(
        dataset=name, global_batch_size=h_count * rng.choice([1, 2, 4]),
        shard_index=rng.randrange(h_count), shard_count=h_count,
        start_step=rng.randrange(0, 50), num_steps=rng.randint(1, 3), stream_state=state,
        config_fingerprint=self.fingerprints[name])
    kind, got = self.ask(request)
    if kind == "ok":
      if not self._grain_reads_back(name, state):
        return request, kind, "served a position that Grain's own iterator reads back otherwise"
      try:
        want = self.oracle.fetch(request)
      except Exception as e:  # pylint: disable=broad-except
        return request, kind, f"served, but embedded mode refused it: {type(e).__name__}: {e}"
      same = len(got) == len(want) and all(
          g.next_stream_state == w.next_stream_state and
          [t.data for t in g.leaves] == [bytes(memoryview(a)) for a in w.leaves]
          for g, w in zip(got, want))
      return request, kind, None if same else "served other batches than embedded mode"
    if grpc.StatusCode[kind] not in ALLOWED:
      return request, kind, f"{kind}: {got}"
    return request, kind, None

  def _grain_reads_back(self, name: str, text: str) -> bool:
    """Whether Grain's own pipeline, restored from `text`, reads back the
    same position: what being a position of the stream means."""
    if not text:  # no position: the stream's start
      return True
    it = iter(self.datasets.get(name).pipeline(1))
    try:
      state = json.loads(text)
      it.set_state(grain_private.state_from_json(state))
      return contract.position_text(it.get_state()) == contract.position_text(state)
    except Exception:  # pylint: disable=broad-except
      return False

  def check(self) -> str | None:
    """Why the server is no longer well (None if it is)."""
    reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=30)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
      return f"health {reply.status}"
    for name in DATASETS:
      request = pb.BatchRequest(dataset=name, global_batch_size=4, shard_count=1,
                                num_steps=3, start_step=5, stream_state=self.positions[name][5])
      kind, got = self.ask(request)
      want = self.oracle.fetch(request)
      if kind != "ok" or [[t.data for t in g.leaves] for g in got] != [
          [bytes(memoryview(a)) for a in w.leaves] for w in want]:
        return f"dataset {name!r} no longer served exactly ({kind})"
    m = top.scrape(f"127.0.0.1:{self.server.metrics_port}", timeout_s=30)
    if m.get(("elevator_worker_restarts_total", ()), 0):
      return "a worker died"
    if m.get(("elevator_stream_sessions", ()), 0) > 2 * MAX_STREAM_SESSIONS:
      return f"{m[('elevator_stream_sessions', ())]:.0f} sessions held"
    if hasattr(self, "rest_rss") and self._rss() - self.rest_rss > self.args.rss_mb << 20:
      return f"the workers grew by {(self._rss() - self.rest_rss) >> 20} MiB"
    return None

  def close(self) -> None:
    self.channel.close()
    self.server.stop()


def _save(out: pathlib.Path, n: int, request: pb.BatchRequest, kind: str, why: str) -> None:
  out.mkdir(parents=True, exist_ok=True)
  record = {"why": why, "answer": kind, "dataset": request.dataset,
            "global_batch_size": request.global_batch_size,
            "shard_index": request.shard_index, "shard_count": request.shard_count,
            "start_step": request.start_step, "num_steps": request.num_steps,
            "stream_state": request.stream_state}
  (out / f"positions-{n:04d}.json").write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seconds", type=float, default=60.0)
  parser.add_argument("--seed", type=int, default=None)
  parser.add_argument("--out", default="fuzz-findings")
  parser.add_argument("--check-every", type=int, default=200)
  parser.add_argument("--rss-mb", type=int, default=256)
  parser.add_argument("--keep", type=int, default=10)
  args = parser.parse_args(argv)
  seed = args.seed if args.seed is not None else random.randrange(1 << 30)
  rng = random.Random(seed)
  with tempfile.TemporaryDirectory(prefix="fuzz-positions-") as tmp:
    root = pathlib.Path(tmp)
    _write_data(root)
    run = Run(root, args)
    answers: collections.Counter[str] = collections.Counter()
    findings = 0
    began = time.monotonic()
    n = 0
    try:
      while time.monotonic() - began < args.seconds:
        n += 1
        request, kind, why = run.one(rng)
        answers[kind] += 1
        if why is not None:
          findings += 1
          if findings <= args.keep:
            print(f"fuzz-positions: finding {findings}: {why}\n  {request}", flush=True)
            _save(pathlib.Path(args.out), findings, request, kind, why)
        if n % args.check_every == 0 and (why := run.check()) is not None:
          findings += 1
          print(f"fuzz-positions: after {n} inputs: {why}", flush=True)
          break
      if findings == 0 and (why := run.check()) is not None:
        findings += 1
        print(f"fuzz-positions: at the end: {why}", flush=True)
    finally:
      run.close()
  shown = ", ".join(f"{k} {v}" for k, v in answers.most_common())
  print(f"fuzz-positions: answers: {shown}")
  print(f"fuzz-positions: seed {seed}: {n} inputs in {time.monotonic() - began:.0f} s, "
        f"{findings} findings", flush=True)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())
