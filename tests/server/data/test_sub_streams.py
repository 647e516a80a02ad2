"""Sub-streams (`stream_shards = N`): global batch k is the N sub-batches k
one after another, sub-stream j Grain's own pipeline over records[j::N]
with G/N rows a step, for any H, transport and number of servers; N = 1 is
the stream of today, batch for batch; the cursor holds the N positions and
resumes on another H, another G (a multiple of N) and other servers."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.client import (InvalidRequestError, RemoteDataset, RetryPolicy,
                                   TransportOptions)
from grain_elevator.pipelines import examples, text
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import ConfigError
from grain_elevator.server.data import config as config_lib
from grain_elevator.server import Server, ServerOptions
from grain_elevator.server.data import registry
from grain_elevator.server.serving.stream_sessions import StreamSessions
from grain_elevator.tools import top
from grain_elevator.tools.testing.launcher import LocalServer
import datasets
from helpers import assert_streams_equal, wait_for, worker_pids

IMAGE = {"height": 4, "width": 4, "channels": 3}
LENGTH, BINS = 32, 8
G = 8
STEPS = 10


def _lm(n: int | None, **keys) -> dict:
  shards = {} if n is None else {"stream_shards": n}
  return datasets.packed_text(seed=23, num_epochs=0, length=LENGTH, bins=BINS,
                              batch_fn=datasets.BATCH_AND_PAD, **shards, **keys)


CONFIG = datasets.config_text(
    lm=_lm(None), lm1=_lm(1), lm2=_lm(2), lm4=_lm(4),
    # a flat_map, evaluation mode: each sub-stream pads its own last batch
    rows2=datasets.images("shards/train-*.array_record",
                          pipeline="grain_elevator.pipelines.examples:decode_rows", seed=22,
                          drop_remainder=False, stream_shards=2),
    # training mode over a finite stream: ends with the first sub-stream that ends
    few2=datasets.images("shards/train-*.array_record", pipeline=datasets.DECODE_SOME,
                         seed=21, options={"labels": [1, 3, 7]}, stream_shards=2),
    a=datasets.images("shards/train-00000*.array_record", seed=24),
    b=datasets.images("shards/train-00001*.array_record", seed=25),
    mix=datasets.mixture(a=0.6, b=0.4),
    mixed2=datasets.dataset(None, source="mix",
                            pipeline="grain_elevator.pipelines.examples:only_labels",
                            options={"labels": [0, 2, 4]}, stream_shards=2),
)


@pytest.fixture(scope="module")
def config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = datasets.text_root(tmp_path_factory.mktemp("sub-streams"), docs=160, images=data_dir)
  (root / "elevator.toml").write_text(CONFIG)
  return root / "elevator.toml"


@pytest.fixture(scope="module")
def servers(serve, config) -> list:
  """Two in-process servers of the config (2 workers and 1): replicas of
  unequal size, the sub-streams spread over their workers."""
  return [serve(config, workers=2), serve(config, workers=1)]


# -- the oracle: Grain in one process, per sub-stream ---------------------------

def _records(files: list[str], seed: int, epochs: int | None) -> grain.MapDataset:
  source = array_record_data_source.ArrayRecordDataSource(sorted(files))
  return grain.MapDataset.source(source).seed(seed).shuffle().repeat(epochs)


class _Chunk(grain.experimental.FlatMapTransform):
  def flat_map(self, element):
    tokens = element["tokens"]
    return [{"tokens": tokens[i:i + LENGTH]} for i in range(0, len(tokens), LENGTH)]


def _masked(values: list, *, g: int) -> dict:
  leaves = {k: np.stack([v[k] for v in values]) for k in values[0]}
  out = {k: np.concatenate([a, np.zeros((g - len(a), *a.shape[1:]), a.dtype)])
         for k, a in leaves.items()}
  out[contract.MASK_KEY] = np.arange(g) < len(values)
  return out


def sub_stream(config: pathlib.Path, name: str, rows: int, j: int, n: int) -> grain.IterDataset:
  """Sub-stream j of n of dataset `name`, in batches of `rows`: the pipeline
  over records[j::n], written out with Grain's own operations."""
  root = config.parent
  shards = sorted(str(p) for p in (root / "shards").glob("train-*.array_record"))
  texts = sorted(str(p) for p in (root / "text").glob("*.array_record"))
  if name.startswith("lm"):
    head = text.tokenize(_records(texts, 23, None)[j::n],
                         tokenizer=str(root / "tokenizer.json"), field="text")
    chunks = grain.experimental.FlatMapIterDataset(head.to_iter_dataset(), _Chunk())
    packed = grain.experimental.FirstFitPackIterDataset(
        chunks, length_struct={"tokens": LENGTH}, num_packing_bins=BINS, shuffle_bins=False)
    return packed.batch(rows, batch_fn=functools.partial(grain.experimental.batch_and_pad,
                                                         batch_size=rows))
  if name == "rows2":
    head = examples.decode_rows(_records(shards, 22, 1)[j::n], **IMAGE)
    return head.to_iter_dataset().batch(rows, drop_remainder=False,
                                        batch_fn=functools.partial(_masked, g=rows))
  if name == "few2":
    head = examples.decode_some(_records(shards, 21, 1)[j::n], **IMAGE, labels=[1, 3, 7])
    return head.to_iter_dataset().batch(rows)
  if name == "mixed2":
    a = examples.decode_images(_records(shards[:1], 24, None), **IMAGE)
    b = examples.decode_images(_records(shards[1:2], 25, None), **IMAGE)
    mixed = grain.MapDataset.mix([a, b], [0.6, 0.4])[j::n]
    return examples.only_labels(mixed, labels=[0, 2, 4]).to_iter_dataset().batch(rows)
  raise KeyError(name)


def global_batches(config: pathlib.Path, name: str, g: int, n: int, steps: int | None,
                   *, training: bool = True) -> list[dict]:
  """The contract's global batches: sub-batch k of each sub-stream, one
  after another; training mode ends with the first sub-stream that ends,
  evaluation mode with the last, one that ended giving zero rows."""
  its = [iter(sub_stream(config, name, g // n, j, n)) for j in range(n)]
  out = []
  while steps is None or len(out) < steps:
    parts = [next(it, None) for it in its]
    if (training and None in parts) or all(p is None for p in parts):
      break
    like = next(p for p in parts if p is not None)
    parts = [p if p is not None else {k: np.zeros_like(v) for k, v in like.items()}
             for p in parts]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in like})
  return out


def _rows(batch: dict, h: int, n: int) -> dict:
  g = len(next(iter(batch.values())))
  return {k: v[h * g // n:(h + 1) * g // n] for k, v in batch.items()}


def _take(it, k: int) -> list:
  return [next(it) for _ in range(k)]


def _targets(servers: list, config: pathlib.Path, kind: str) -> tuple[list[str], str]:
  if kind == "embedded":
    return [f"local:{config}"], "auto"
  return [s.target for s in servers], kind


# -- exact --------------------------------------------------------------------

@pytest.mark.parametrize("kind", [pytest.param("embedded", marks=pytest.mark.grain_contract),
                                  "bulk", "grpc"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_host_gets_its_rows_of_the_sub_streams(config, servers, n, kind):
  """N in {1, 2, 4}, H in {1, 2, 4}, every host: Grain's own sub-streams."""
  want = global_batches(config, f"lm{n}", G, n, STEPS)
  targets, transport = _targets(servers, config, kind)
  for hosts in (1, 2, 4):
    for h in range(hosts):
      with RemoteDataset(targets, f"lm{n}", G, shard_index=h, shard_count=hosts,
                         transport=TransportOptions(kind=transport)) as ds:
        got = _take(iter(ds), STEPS)
      assert assert_streams_equal(got, [_rows(b, h, hosts) for b in want]) == STEPS, (h, hosts)


def test_one_sub_stream_is_the_stream_of_today(config, servers):
  """stream_shards = 1 is the stream without the key: the same fingerprint
  (its cursors stay valid) and the same batches."""
  fingerprints = {}
  for n in (None, 1, 2):
    path = datasets.write_config(config.parent / f"lm-{n}.toml", lm=_lm(n))
    opened = registry.Datasets(config_lib.load_config(path), open_now=False)
    fingerprints[n] = opened.get("lm").info.config_fingerprint
  assert fingerprints[1] == fingerprints[None] != fingerprints[2]
  with RemoteDataset(servers[0].target, "lm", G) as ds:
    it = iter(ds)
    today = _take(it, STEPS)
    saved = json.loads(json.dumps(it.get_state()))
  with RemoteDataset(servers[0].target, "lm1", G) as ds:
    it = iter(ds)
    assert assert_streams_equal(_take(it, STEPS), today) == STEPS
    assert json.loads(json.dumps(it.get_state()))["stream_state"] == saved["stream_state"]


@pytest.mark.parametrize("name,n", [("rows2", 2), ("few2", 2), ("mixed2", 2)])
def test_evaluation_training_and_mixture_sub_streams(config, servers, name, n):
  """Evaluation mode goes on to the last sub-stream's end, those ended
  giving masked zero rows; training mode ends with the first; a stream
  over a mixture's records slices them as any records."""
  finite = name != "mixed2"
  g = 16 if name == "rows2" else G
  want = global_batches(config, name, g, n, None if finite else STEPS,
                        training=name != "rows2")
  assert want
  if name == "rows2":  # its sub-streams end at different steps: the rule is tested
    masks = [b[contract.MASK_KEY].reshape(n, -1).any(axis=1) for b in want]
    assert not all(m.all() for m in masks)
  for target in (servers[0].target, f"local:{config}"):
    for h, hosts in ((0, 1), (1, 2)):
      with RemoteDataset(target, name, g, shard_index=h, shard_count=hosts) as ds:
        it = iter(ds)
        got = list(it) if finite else _take(it, STEPS)
      assert assert_streams_equal(got, [_rows(b, h, hosts) for b in want]) == len(want)


# -- the cursor ---------------------------------------------------------------

def test_the_cursor_resumes_on_other_hosts_servers_and_a_new_g(config, servers):
  """Saved on 1 host of two servers (JSON: the 4 positions), resumed on 2
  and 4 hosts of one server and of embedded mode; then G doubles, each
  sub-stream continuing from its position."""
  n, at = 4, 5
  want = global_batches(config, "lm4", G, n, at + 4)
  with RemoteDataset([s.target for s in servers], "lm4", G) as ds:
    it = iter(ds)
    assert_streams_equal(_take(it, at), want[:at])
    saved = json.loads(json.dumps(it.get_state()))
  assert saved["step"] == at and len(saved["stream_state"]) == n
  for target in (servers[1].target, f"local:{config}"):
    for hosts in (2, 4):
      for h in range(hosts):
        with RemoteDataset(target, "lm4", G, shard_index=h, shard_count=hosts) as ds:
          it = iter(ds)
          it.set_state(saved)
          assert assert_streams_equal(_take(it, 4), [_rows(b, h, hosts) for b in want[at:]]) == 4
  # G 8 -> 16: sub-stream j's elements go on from element at*G/N of it.
  elements = [_take(iter(sub_stream(config, "lm4", 1, j, n)), (at + 4 * 2) * G // n)
              for j in range(n)]
  with RemoteDataset(servers[0].target, "lm4", 2 * G) as ds:
    it = iter(ds)
    it.set_state(saved)
    got = _take(it, 4)
  for k, batch in enumerate(got):
    first = at * G // n + k * 2 * G // n
    want_k = {key: np.concatenate([np.concatenate([e[key] for e in elements[j][first:first + 4]])
                                   for j in range(n)]) for key in batch}
    assert set(want_k) == set(batch)
    for key in batch:
      np.testing.assert_array_equal(batch[key], want_k[key], err_msg=f"step {k} {key}")


def test_a_skip_moves_every_sub_stream(config, servers):
  want = global_batches(config, "lm2", G, 2, 12)
  with RemoteDataset(servers[0].target, "lm2", G) as ds:
    it = iter(ds)
    assert_streams_equal(_take(it, 2), want[:2])
    it.skip(5)
    saved = json.loads(json.dumps(it.get_state()))
    assert assert_streams_equal(_take(it, 3), want[7:10]) == 3
  assert saved["skips"] == [[2, 7]]
  with RemoteDataset(f"local:{config}", "lm2", G, shard_index=1, shard_count=2) as ds:
    it = iter(ds)
    it.set_state(saved)
    assert assert_streams_equal(_take(it, 3), [_rows(b, 1, 2) for b in want[7:10]]) == 3


def test_an_evaluation_skip_passes_a_sub_streams_end_but_not_the_streams(config, servers):
  """rows2's sub-streams end at different steps: a skip past the first
  end goes on with that one's padding rows; one past the last is refused,
  the iterator staying where it was."""
  g = 16
  want = global_batches(config, "rows2", g, 2, None, training=False)
  ends = [len(list(sub_stream(config, "rows2", g // 2, j, 2))) for j in range(2)]
  first_end, last = min(ends), len(want)
  assert first_end < last - 1
  for target in (servers[0].target, f"local:{config}"):
    with RemoteDataset(target, "rows2", g) as ds:
      it = iter(ds)
      it.skip(first_end + 1)  # one step past the first sub-stream's end
      assert assert_streams_equal(list(it), want[first_end + 1:]) == last - first_end - 1
    with RemoteDataset(target, "rows2", g) as ds:
      it = iter(ds)
      next(it)
      with pytest.raises(InvalidRequestError, match="passes the end of the stream"):
        it.skip(last)
      assert assert_streams_equal(_take(it, 2), want[1:3]) == 2


def test_one_worker_keeps_each_sub_streams_place(config, monkeypatch):
  """A worker serving several sub-streams with no bytes for sessions (as
  embedded mode has) keeps each one's live iterator: chunk after chunk of
  each, in turns, continue without restoring a position."""
  ds = registry.Datasets(config_lib.load_config(config), open_now=False).get("lm4")
  opened = []
  for part in ds.parts:
    monkeypatch.setattr(part, "open", lambda g, state, _open=part.open: (
        opened.append(state), _open(g, state))[1])
  sessions = StreamSessions(0)
  positions = [part.info.stream_start for part in ds.parts]
  for _ in range(3):
    for j, part in enumerate(ds.parts):
      for (_, after), _ in sessions.batches(part, 2, positions[j], 2, (1, 0)):
        positions[j] = after
  assert len(opened) == len(ds.parts), "each sub-stream opened once, at its first chunk"


# -- spread over servers, and one dies ---------------------------------------

@pytest.mark.slow  # starts two `elevator serve`, kills one
def test_sub_streams_spread_over_servers_and_move_on_when_one_dies(config):
  """Two servers of one worker each: the 4 sub-streams keep both busy; one
  is SIGKILLed mid-stream and its sub-streams go on from their positions
  on the other, exact."""
  steps = 30
  want = global_batches(config, "lm4", G, 4, steps)
  a, b = LocalServer(str(config), workers=1), LocalServer(str(config), workers=1)
  try:
    with RemoteDataset([a.target, b.target], "lm4", G, retry=RetryPolicy(timeout_s=60),
                       transport=TransportOptions(steps_per_request=2)) as ds:
      it = iter(ds)
      got = _take(it, 8)
      serving = {s.replica[0] for s in it._backend.data_slots()  # pylint: disable=protected-access
                 if s.served}
      assert serving == {a.target, b.target}, "the sub-streams spread over both servers"
      for pid in [b.proc.pid, *worker_pids(b)]:
        os.kill(pid, signal.SIGKILL)
      got += _take(it, steps - 8)
  finally:
    a.stop()
    b.stop()
  assert assert_streams_equal(got, want) == steps


def test_each_sub_streams_head_is_computed_by_every_worker(config):
  """One server of two workers: each owns a sub-stream (consecutive
  sub-streams route to consecutive workers), and each one's parallel head
  deals its tasks to both (counted as their answers arrive)."""
  steps = 4 * STEPS
  want = global_batches(config, "lm2", G, 2, steps)
  with Server(str(config), ServerOptions(port=0, workers=2, metrics_port=0)) as server:

    def tasks() -> dict[tuple[int, int], float]:
      out = {}
      for (name, labels), value in top.scrape(f"127.0.0.1:{server.metrics_port}",
                                              timeout_s=30).items():
        if name == "elevator_head_tasks_total":
          labels = dict(labels)
          out[int(labels["owner"]), int(labels["worker"])] = value
      return out

    with RemoteDataset(server.target, "lm2", G) as ds:
      it = iter(ds)
      assert assert_streams_equal(_take(it, steps), want) == steps
      everywhere = lambda: all(tasks().get((owner, worker), 0) > 0
                               for owner in (0, 1) for worker in (0, 1))
      wait_for(everywhere, "both workers' tasks of both owners' sub-streams")
    assert {owner for owner, _ in tasks()} == {0, 1}


def test_describe_names_the_sub_streams(config, servers, elevator):
  code, out, err = elevator("describe", servers[0].target, "--dataset", "lm4", "-G", "8")
  assert code == 0, err
  (info,) = json.loads(out)
  assert (info["stream"], info["stream_shards"]) == (True, 4)
  code, out, err = elevator("describe", servers[0].target, "--dataset", "lm1")
  assert code == 0 and "stream_shards" not in json.loads(out)[0], err


# -- refused, precisely ---------------------------------------------------------

def test_a_batch_size_not_a_multiple_of_n_is_refused(config, servers):
  with RemoteDataset(servers[0].target, "lm4", 6, shard_index=0, shard_count=2) as ds:
    with pytest.raises(InvalidRequestError, match=r"4 sub-streams .* multiple of 4, got 6"):
      next(iter(ds))
  with RemoteDataset(servers[0].target, "lm4", G) as ds:
    it = iter(ds)
    next(it)
    saved = json.loads(json.dumps(it.get_state()))
  with RemoteDataset(servers[0].target, "lm4", 10, shard_index=0, shard_count=2) as ds:
    with pytest.raises(InvalidRequestError, match="multiple of 4, got 10"):
      iter(ds).set_state(saved)
  bad = {**saved, "stream_state": saved["stream_state"][:3]}
  with RemoteDataset(servers[0].target, "lm4", G) as ds:
    with pytest.raises(InvalidRequestError,
                       match=r"list of their 4 positions \(one a sub-stream\), got a list of 3"):
      iter(ds).set_state(bad)


def test_a_request_reading_another_number_of_sub_streams_is_refused(config, servers):
  """A client that predates sub-streams (or an old Describe) is told, not
  served another host's rows."""
  from grain_elevator.client.embedded import EmbeddedBackend  # pylint: disable=g-import-not-at-top
  backend = EmbeddedBackend(str(config))
  (info,) = backend.describe("lm2")
  request = pb.BatchRequest(dataset="lm2", global_batch_size=G, shard_count=1, start_step=0,
                            num_steps=1, stream_state=info.stream_start)
  with pytest.raises(InvalidRequestError, match="2 sub-streams, and this request reads it as 1"):
    backend.fetch(request)
  request.stream_shards, request.stream_shard = 2, 2
  with pytest.raises(InvalidRequestError, match=r"stream_shard must be in \[0, 2\), got 2"):
    backend.fetch(request)


@pytest.mark.parametrize("value,match", [(0, r"must be in \[1, 32\]"),
                                         (33, r"must be in \[1, 32\]"),
                                         (True, "must be an integer")])
def test_a_bad_stream_shards_is_a_config_error(config, value, match):
  path = datasets.write_config(config.parent / "bad.toml", lm=_lm(value))
  with pytest.raises(ConfigError, match=f"'stream_shards' {match}"):
    config_lib.load_config(path)
