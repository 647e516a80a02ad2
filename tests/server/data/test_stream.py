"""Stream datasets (filter, flat_map, packing, batch_fn): what a server and
embedded mode serve is Grain's own single-process pipeline, batch for batch,
for any number of hosts; positions round-trip through JSON and resume in
fresh iterators, on another host count, on another G."""

from __future__ import annotations

import functools
import json
import pathlib

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.client import (InvalidRequestError, RemoteDataset, StreamMismatchError,
                                   TransportOptions)
from grain_elevator.pipelines import examples, text
from grain_elevator.proto import contract
import datasets
from helpers import assert_streams_equal

IMAGE = {"height": 4, "width": 4, "channels": 3}
TEXT_DOCS = 120
LENGTH, BINS = 32, 8


class _Chunk(grain.experimental.FlatMapTransform):
  """A document's tokens in pieces of at most LENGTH (the test's own)."""

  def flat_map(self, element):
    tokens = element["tokens"]
    return [{"tokens": tokens[i:i + LENGTH]} for i in range(0, len(tokens), LENGTH)]

# The streams served (G and H vary per test); paths relative to the config.
CONFIG = datasets.config_text(
    # a filter: the records of three labels, 2 epochs; a batch_fn
    few=datasets.images("shards/train-*.array_record", pipeline=datasets.DECODE_SOME,
                        batch_fn="grain_elevator.pipelines.examples:batch_centered", seed=21,
                        num_epochs=2, options={"labels": [1, 3, 7]}),
    # a flat_map, evaluation mode: the last batch padded, a mask
    rows=datasets.images("shards/train-*.array_record",
                         pipeline="grain_elevator.pipelines.examples:decode_rows", seed=22,
                         drop_remainder=False),
    # text: tokenize, chunk (flat_map), pack, batch_and_pad
    lm=datasets.packed_text(seed=23, num_epochs=0, length=LENGTH, bins=BINS,
                            batch_fn=datasets.BATCH_AND_PAD),
    # text packed by concatenating then splitting
    lm_cts=datasets.dataset("text/*.array_record", pipeline=datasets.TOKENIZE,
                            iter_pipeline="grain.experimental:ConcatThenSplitIterDataset",
                            seed=26, num_epochs=0,
                            options={"tokenizer": "tokenizer.json", "field": "text"},
                            iter_options={"length_struct": {"tokens": 32}}),
    # text packed, one epoch, the last batch padded and masked
    lm_once=datasets.packed_text(seed=27, drop_remainder=False, length=128, bins=BINS),
    # two 1:1 datasets, mixed
    a=datasets.images("shards/train-00000*.array_record", seed=24),
    b=datasets.images("shards/train-00001*.array_record", seed=25),
    mix=datasets.mixture(a=0.6, b=0.4),
    # a stream over the mixture's records
    mixed_few=datasets.dataset(None, source="mix",
                               pipeline="grain_elevator.pipelines.examples:only_labels",
                               options={"labels": [0, 2, 4]}),
)


@pytest.fixture(scope="module")
def stream_config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("streams")
  datasets.text_root(root, docs=TEXT_DOCS, images=data_dir)
  (root / "elevator.toml").write_text(CONFIG)
  return root / "elevator.toml"


@pytest.fixture(scope="module")
def stream_server(serve, stream_config):
  """An in-process server of two workers (the streams' heads are shared)."""
  return serve(stream_config, workers=2)


def _records(files: list[str], seed: int, epochs: int | None) -> grain.MapDataset:
  """The contract's records, written out with Grain's own operations."""
  source = array_record_data_source.ArrayRecordDataSource(sorted(files))
  return grain.MapDataset.source(source).seed(seed).shuffle().repeat(epochs)


def _masked(values: list, *, g: int):
  """Evaluation mode's batch, as the contract states it: stacked, zero rows
  to G, and the mask."""
  leaves = {k: np.stack([v[k] for v in values]) for k in values[0]}
  out = {k: np.concatenate([a, np.zeros((g - len(a), *a.shape[1:]), a.dtype)])
         for k, a in leaves.items()}
  out[contract.MASK_KEY] = np.arange(g) < len(values)
  return out


def oracle(config: pathlib.Path, name: str, g: int) -> grain.IterDataset:
  """Grain's single-process pipeline for dataset `name` and G."""
  root = config.parent
  shards = sorted(str(p) for p in (root / "shards").glob("train-*.array_record"))
  if name == "few":
    head = examples.decode_some(_records(shards, 21, 2), **IMAGE, labels=[1, 3, 7])
    return head.to_iter_dataset().batch(g, drop_remainder=True,
                                       batch_fn=examples.batch_centered)
  if name == "rows":
    head = examples.decode_rows(_records(shards, 22, 1), **IMAGE)
    return head.to_iter_dataset().batch(g, drop_remainder=False,
                                       batch_fn=functools.partial(_masked, g=g))
  if name == "lm":
    texts = sorted(str(p) for p in (root / "text").glob("*.array_record"))
    head = text.tokenize(_records(texts, 23, None), tokenizer=str(root / "tokenizer.json"),
                         field="text")
    chunks = grain.experimental.FlatMapIterDataset(head.to_iter_dataset(), _Chunk())
    packed = grain.experimental.FirstFitPackIterDataset(
        chunks, length_struct={"tokens": LENGTH}, num_packing_bins=BINS, shuffle_bins=False)
    return packed.batch(g, drop_remainder=True,
                        batch_fn=functools.partial(grain.experimental.batch_and_pad,
                                                   batch_size=g))
  if name == "lm_cts":
    texts = sorted(str(p) for p in (root / "text").glob("*.array_record"))
    head = text.tokenize(_records(texts, 26, None), tokenizer=str(root / "tokenizer.json"),
                         field="text")
    return grain.experimental.ConcatThenSplitIterDataset(
        head.to_iter_dataset(), length_struct={"tokens": 32}).batch(g)
  if name == "mixed_few":
    a = examples.decode_images(_records(shards[:1], 24, None), **IMAGE)
    b = examples.decode_images(_records(shards[1:2], 25, None), **IMAGE)
    mixed = grain.MapDataset.mix([a, b], [0.6, 0.4])
    return examples.only_labels(mixed, labels=[0, 2, 4]).to_iter_dataset().batch(g)
  raise KeyError(name)


def _rows(batch: dict, h: int, n: int) -> dict:
  g = len(next(iter(batch.values())))
  return {k: v[h * g // n:(h + 1) * g // n] for k, v in batch.items()}


def _take(it, k: int) -> list:
  return [next(it) for _ in range(k)]


@pytest.mark.parametrize("name,g,steps", [
    ("few", 16, None), ("rows", 24, None), ("lm", 8, 12), ("mixed_few", 8, 20)])
def test_embedded_mode_is_grains_own_pipeline(stream_config, name, g, steps):
  want = oracle(stream_config, name, g)
  got = RemoteDataset.embedded(str(stream_config), name, g)
  want_steps = list(want) if steps is None else _take(iter(want), steps)
  got_steps = list(got) if steps is None else _take(iter(got), steps)
  assert want_steps
  assert assert_streams_equal(got_steps, want_steps) == len(want_steps)


@pytest.mark.parametrize("name,g,h,n,kind", [
    ("few", 16, 1, 2, "bulk"), ("rows", 24, 2, 4, "grpc"), ("lm", 8, 3, 4, "bulk"),
    ("lm", 8, 0, 1, "grpc"), ("mixed_few", 8, 1, 2, "bulk")])
def test_a_server_serves_each_host_its_rows(stream_server, stream_config, name, g, h, n,
                                            kind):
  steps = None if name in ("few", "rows") else 15
  want = oracle(stream_config, name, g)
  want_steps = [_rows(b, h, n) for b in (list(want) if steps is None
                                         else _take(iter(want), steps))]
  with RemoteDataset(stream_server.target, name, g, shard_index=h, shard_count=n,
                     transport=TransportOptions(kind=kind, steps_per_request=4)) as ds:
    it = iter(ds)
    got = list(it) if steps is None else _take(it, steps)
  assert assert_streams_equal(got, want_steps) == len(want_steps)


@pytest.mark.parametrize("name,g,at", [("few", 16, 3), ("rows", 24, 5), ("lm", 8, 9),
                                       ("lm_cts", 4, 7)])
def test_a_position_resumes_on_another_host_count_and_replica(stream_server, stream_config,
                                                              name, g, at):
  """Saved on 1 host of the server, through JSON, resumed on 2 hosts of
  embedded mode and of the server: the rest is Grain's."""
  want = list(_take(iter(oracle(stream_config, name, g)), at + 6))
  with RemoteDataset(stream_server.target, name, g) as ds:
    it = iter(ds)
    assert_streams_equal(_take(it, at), want[:at])
    saved = json.loads(json.dumps(it.get_state()))
  assert saved["step"] == at and isinstance(saved["stream_state"], dict)
  for target in (stream_server.target, f"local:{stream_config}"):
    for h in (0, 1):
      with RemoteDataset(target, name, g, shard_index=h, shard_count=2) as ds:
        it = iter(ds)
        it.set_state(saved)
        assert assert_streams_equal(_take(it, 6), [_rows(b, h, 2) for b in want[at:]]) == 6


def test_a_new_batch_size_continues_from_the_position(stream_server, stream_config):
  """Ramp-up: G changes at a checkpoint; the stream's elements continue
  where the old G left them, steps counted afresh."""
  with RemoteDataset(stream_server.target, "lm", 8) as ds:
    it = iter(ds)
    first = _take(it, 4)
    saved = json.loads(json.dumps(it.get_state()))
  with RemoteDataset(stream_server.target, "lm", 16) as ds:
    it = iter(ds)
    it.set_state(saved)
    assert it.get_state()["step"] == 0
    after = _take(it, 3)
  rows = [r for b in _take(iter(oracle(stream_config, "lm", 8)), 10) for r in b["tokens"]]
  got = [r for b in first + after for r in b["tokens"]]
  assert np.array_equal(np.stack(got), np.stack(rows[:len(got)]))


# G = 48: 13 and 12 steps (lm_once's last padded and masked). Grain's check
# reads the rest of the stream from every step, in a fresh iterator: at G =
# 16 (39 and 34 steps) that was ~30 s of a loaded machine's time.
@pytest.mark.parametrize("name,g", [("few", 48), ("lm_once", 48)])
def test_grains_checkpoint_check_holds_at_every_step(stream_server, name, g):
  """Grain's own check, on the service: a packed stream restored at every
  step continues exactly, to its end."""
  grain.experimental.assert_equal_output_after_checkpoint(
      RemoteDataset(stream_server.target, name, g))


def test_a_finite_stream_ends_at_the_same_step_on_every_host(stream_server, stream_config):
  lengths = set()
  for h in range(3):
    with RemoteDataset(stream_server.target, "rows", 24, shard_index=h, shard_count=3,
                       transport=TransportOptions(steps_per_request=5)) as ds:
      lengths.add(len(list(ds)))
  assert lengths == {len(list(oracle(stream_config, "rows", 24)))}


def test_a_position_of_another_stream_or_made_up_is_refused(stream_server):
  with RemoteDataset(stream_server.target, "few", 16) as ds:
    it = iter(ds)
    next(it)
    state = it.get_state()
  with RemoteDataset(stream_server.target, "rows", 24) as ds:
    with pytest.raises(StreamMismatchError, match="dataset: saved 'few'"):
      iter(ds).set_state(state)
  with RemoteDataset(stream_server.target, "few", 16) as ds:
    it = iter(ds)
    it.set_state({**state, "stream_state": {"parent": 5}})
    with pytest.raises(InvalidRequestError, match="stream_state is not a position of this"):
      next(it)
    with pytest.raises(InvalidRequestError, match="must be a Grain iterator state"):
      it.set_state({**state, "stream_state": [1, 2]})


def test_a_pipeline_that_filters_makes_a_stream_dataset_and_says_so(stream_server):
  from grain_elevator.client import describe  # pylint: disable=g-import-not-at-top
  infos = {i.name: i for i in describe(stream_server.target)}
  assert {n for n, i in infos.items() if i.stream} == {"few", "rows", "lm", "lm_cts",
                                                        "lm_once", "mixed_few"}
  # a: the first of 3 shards of 1,000 records, 334 of them.
  assert infos["few"].total_steps(16) is None and infos["a"].total_steps(16) == 334 // 16


def test_opening_a_stream_prices_its_iterator_without_tracing_allocations(stream_config,
                                                                          monkeypatch):
  """A live iterator's bytes are found by walking it
  (server/data/streams/object_bytes.py): tracing under native threads that
  attach to Python (obstore's, as each read completes) crashed this very
  process on CPython 3.11."""
  import tracemalloc  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data import config as config_lib  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data import registry  # pylint: disable=g-import-not-at-top
  started = []
  monkeypatch.setattr(tracemalloc, "start", lambda *a: started.append(a))
  opened = registry.Datasets(config_lib.load_config(str(stream_config)), open_now=False)
  lm = opened.get("lm")
  assert not started
  # The estimate holds what one iterator keeps: more than one global batch's rows.
  g = 64
  assert lm.iterator_bytes(g) > g * lm.info.element_spec.record_bytes
  assert lm.iterator_bytes(g) - g * lm.info.element_spec.record_bytes > 10_000
