"""Explain and summary of a stream of N sub-streams (`stream_shards = N`):
each sub-stream this host has rows of is explained from its own position
and the rows put one after another; a summary counts each sub-stream's
sub-batches from its position and adds them up. Proved against the served
batches: every row's segments, read from the records they name and
tokenized, are the served row's tokens slot for slot, and a summary's
tokens are the served global batches' non-padding slots; served and
embedded, on 1 and 2 hosts."""

from __future__ import annotations

import functools
import json
import pathlib

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.client import EndOfDataError, InvalidRequestError, RemoteDataset
from grain_elevator.pipelines import text
from grain_elevator.proto import contract
from grain_elevator.proto import limits
from grain_elevator.tools import cli
import datasets

LENGTH, BINS = 32, 8
G = 8
STEPS = 8


def _lm(n: int | None, **keys) -> dict:
  shards = {} if n is None else {"stream_shards": n}
  return datasets.packed_text(seed=23, length=LENGTH, bins=BINS,
                              batch_fn=datasets.BATCH_AND_PAD, **shards, **keys)


CONFIG = datasets.config_text(
    lm=_lm(None, num_epochs=0), lm2=_lm(2, num_epochs=0), lm4=_lm(4, num_epochs=0),
    # one epoch, evaluation mode: each sub-stream pads its own last batch, and
    # the one that ends first gives padding rows while the other goes on
    once2=_lm(2, num_epochs=1, drop_remainder=False),
)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> pathlib.Path:
  root = datasets.text_root(tmp_path_factory.mktemp("sub-stream-provenance"), docs=60)
  (root / "elevator.toml").write_text(CONFIG)
  return root / "elevator.toml"


@pytest.fixture(scope="module")
def server(serve, config):
  return serve(config, workers=2)


def _targets(server, config) -> list[str]:
  return [server.target, f"local:{config}"]


_steps: dict[str, list[tuple[dict, dict]]] = {}


def _served(config: pathlib.Path, name: str) -> list[tuple[dict, dict]]:
  """Embedded mode's (state where the step starts, global batch) for each
  step, to the stream's end or STEPS + 1 of them; read once per dataset (the
  module's tests only read them)."""
  if name not in _steps:
    got = []
    with RemoteDataset.embedded(str(config), name, G) as ds:
      it = iter(ds)
      while len(got) < (1000 if name == "once2" else STEPS + 1):  # once2: to its end
        state = json.loads(json.dumps(it.get_state()))
        try:
          got.append((state, next(it)))
        except StopIteration:
          break
    _steps[name] = got
  return _steps[name]


@functools.lru_cache(maxsize=None)
def _tokens(config: pathlib.Path, shard: str, record: int) -> np.ndarray:
  """A record's tokens, read and tokenized on their own."""
  raw = array_record_data_source.ArrayRecordDataSource([shard])[record]
  ds = text.tokenize(grain.MapDataset.source([raw]),
                     tokenizer=str(config.parent / "tokenizer.json"), field="text")
  return ds[0]["tokens"]


def _check_rows(config: pathlib.Path, explained: dict, batch: dict, n: int, h: int,
                hosts: int) -> None:
  """`explained` is host h's slice of `batch`, row for row: each row's
  sub-stream is the one its global row lies in, and its segments, read
  from their records, are the served row's tokens and segment ids."""
  rows = explained["rows"]
  first = h * G // hosts
  assert [r["row"] for r in rows] == list(range(G // hosts))
  assert [r["global_row"] for r in rows] == list(range(first, first + G // hosts))
  for row in rows:
    r = row["global_row"]
    j = r // (G // n)
    assert row["stream_shard"] == j
    if row.get("padding"):
      assert not batch[contract.MASK_KEY][r] and not batch["tokens"][r].any()
      continue
    rebuilt = np.zeros(LENGTH, batch["tokens"].dtype)
    ids = np.zeros(LENGTH, batch["tokens_segment_ids"].dtype)
    for k, seg in enumerate(row["segments"]):
      at, length = seg["slot"], seg["length"]
      # sub-stream j's element e is the stream's record position j + N*e
      assert seg["position"] == j + n * seg["element"]
      toks = _tokens(config, seg["shard"], seg["record"])
      rebuilt[at:at + length] = toks[seg["token_offset"]:seg["token_offset"] + length]
      ids[at:at + length] = k + 1
    assert rebuilt.tobytes() == batch["tokens"][r].tobytes(), f"row {r}"
    assert ids.tobytes() == batch["tokens_segment_ids"][r].tobytes(), f"row {r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_each_row_names_the_records_of_its_sub_stream(config, server, n):
  """Steps 0 and 5, 1 and 2 hosts, served and embedded: from a cursor's
  positions, and (step 5, host 0) fast-forwarded by the servers alike."""
  name = f"lm{n}"
  steps = _served(config, name)
  for target in _targets(server, config):
    for step in (0, 5):
      state, batch = steps[step]
      assert len(state["stream_state"]) == n
      for hosts in (1, 2):
        for h in range(hosts):
          ds = RemoteDataset(target, name, G, shard_index=h, shard_count=hosts)
          explained = ds.explain(step, stream_state=state["stream_state"])
          assert (explained["kind"], explained["step"], explained["stream_shards"]) == (
              "stream", step, n)
          assert [json.loads(p) for p in explained["stream_state"]] == state["stream_state"]
          _check_rows(config, explained, batch, n, h, hosts)
          if step and h == 0:
            assert ds.explain(step) == explained


def test_one_stream_is_explained_as_today(config, server):
  """N = 1: no sub-stream keys; the position is one, not a list."""
  state, _ = _served(config, "lm")[2]
  explained = RemoteDataset(server.target, "lm", G).explain(
      2, stream_state=state["stream_state"])
  assert isinstance(explained["stream_state"], str) and "stream_shards" not in explained
  assert all("stream_shard" not in row for row in explained["rows"])


def _non_padding(steps: list[tuple[dict, dict]]) -> int:
  return sum(int(np.count_nonzero(b["tokens_segment_ids"])) for _, b in steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_a_summary_counts_the_served_tokens_of_every_sub_stream(config, server, monkeypatch,
                                                                n):
  """Over [2, 5): the tokens of the served global batches (all hosts'
  rows), the segments and documents every step's explanation names, the
  next positions a cursor holds at 5; served, embedded, from the start and
  in rounds of calls of two steps alike."""
  name = f"lm{n}"
  steps = _served(config, name)
  first, end = 2, 5
  explained = [RemoteDataset(server.target, name, G).explain(
      k, stream_state=steps[k][0]["stream_state"]) for k in range(first, end)]
  segments = [s for e in explained for row in e["rows"] for s in row.get("segments", ())]
  got = {}
  for how in ("served", "embedded", "from the start", "in calls"):
    target = f"local:{config}" if how in ("embedded", "in calls") else server.target
    if how == "in calls":  # the client's per-call bound: two sub-batch steps a call
      monkeypatch.setattr(limits, "MAX_STREAM_SUMMARY_ROWS", 2 * G // n)
    state = None if how == "from the start" else steps[first][0]["stream_state"]
    calls = []
    got[how] = RemoteDataset(target, name, G).summary(first, end, stream_state=state,
                                                     progress=calls.append)
    assert calls == ([2, 1] if how == "in calls" else [end - first]), how
    summary = got[how]
    assert summary["tokens"] == _non_padding(steps[first:end]), how
    assert summary["components"] == {name: {
        "tokens": summary["tokens"], "segments": len(segments),
        "documents": sum(s["token_offset"] == 0 for s in segments), "share": 1.0}}
    assert (summary["rows"], summary["padding_rows"]) == ((end - first) * G, 0)
    assert (summary["steps"], summary["global_batch_size"], summary["stream_shards"]) == (
        [first, end], G, n)
    assert [json.loads(p) for p in summary["next_stream_state"]] == steps[end][0][
        "stream_state"]
  assert got["served"] == got["embedded"] == got["from the start"] == got["in calls"]


def test_evaluation_mode_an_ended_sub_stream_gives_padding(config, server):
  """One epoch: the sub-stream that ends first gives padding rows while the
  other goes on; explain says so row by row, the summary of the whole
  stream counts them as padding, and a step past both ends is refused."""
  steps = _served(config, "once2")
  ended = [k for k, (_, b) in enumerate(steps) if not b[contract.MASK_KEY][:G // 2].any()
           or not b[contract.MASK_KEY][G // 2:].any()]
  assert ended, "both sub-streams end at the same step: the rule is not tested"
  for target in _targets(server, config):
    for k in (ended[0], len(steps) - 1):
      state, batch = steps[k]
      for h in range(2):
        explained = RemoteDataset(target, "once2", G, shard_index=h, shard_count=2).explain(
            k, stream_state=state["stream_state"])
        _check_rows(config, explained, batch, 2, h, 2)
    summary = RemoteDataset(target, "once2", G).summary(0, len(steps))
    assert summary["tokens"] == _non_padding(steps)
    assert summary["padding_rows"] == sum(
        int(np.count_nonzero(~b[contract.MASK_KEY].astype(bool))) for _, b in steps)
    with pytest.raises(EndOfDataError, match="passes the end of the stream"):
      RemoteDataset(target, "once2", G).summary(0, len(steps) + 1)
    past, _ = steps[-1]
    with RemoteDataset(target, "once2", G) as ds:  # the cursor after the last step
      it = iter(ds)
      it.set_state(past)
      next(it)
      after = json.loads(json.dumps(it.get_state()))
    with pytest.raises(InvalidRequestError, match="each of its 2 sub-streams has ended"):
      RemoteDataset(target, "once2", G).explain(len(steps), stream_state=after["stream_state"])


def test_a_position_list_of_the_wrong_shape_is_refused(config, server):
  state, _ = _served(config, "lm2")[1]
  ds = RemoteDataset(server.target, "lm2", G)
  with pytest.raises(InvalidRequestError, match="list of their 2 positions .*got a list of 1"):
    ds.explain(1, stream_state=state["stream_state"][:1])
  with pytest.raises(InvalidRequestError, match="list of their 2 positions .*got dict"):
    ds.summary(1, 2, stream_state=state["stream_state"][0])
  with pytest.raises(InvalidRequestError, match=r"stream_state\[1\] must be a Grain"):
    ds.explain(1, stream_state=[state["stream_state"][0], "x"])
  with pytest.raises(InvalidRequestError, match="is a position .* got list"):
    RemoteDataset(server.target, "lm", G).explain(1, stream_state=state["stream_state"])


def test_the_cli_explains_a_step_from_a_saved_cursor(config, server, tmp_path, capsys):
  state, batch = _served(config, "lm4")[3]
  path = tmp_path / "state.json"
  path.write_text(json.dumps(state))
  assert cli.main(["explain", server.target, "lm4", "-G", str(G), "--step", "3",
                   "--state", str(path), "--host", "1", "--hosts", "2", "--json"]) == 0
  explained = json.loads(capsys.readouterr().out)
  _check_rows(config, explained, batch, 4, 1, 2)
  assert cli.main(["explain", server.target, "lm4", "-G", str(G), "--summary", "3:5",
                   "--state", str(path)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["tokens"] == _non_padding(_served(config, "lm4")[3:5])
