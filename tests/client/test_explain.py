"""What step k held (`RemoteDataset.explain`, `elevator explain`), proved by
construction: read the records an explanation names, run the dataset's
pipeline on them, and rebuild the served rows bit for bit; for a 1:1
dataset over two epochs, a mixture and an evaluation run, served and
embedded, on 1, 2 and 4 hosts."""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.client import EndOfDataError, InvalidRequestError, RemoteDataset
from grain_elevator.client.backend import make_backend
from grain_elevator.pipelines import examples, text
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.tools import cli
from grain_elevator.server import Server, ServerOptions
import datasets
from helpers import wait_for

IMAGE = datasets.IMAGE
G = 12  # 1000 records: the last evaluation batch has 8 padding rows

EVAL_STEPS = -(-1000 // G)  # the conftest's 1000 records
LENGTH = 32

DATASETS = dict(
    twice=datasets.images(seed=71, num_epochs=2),  # 1:1, shuffled, two epochs
    a=datasets.images("shards/train-00000*.array_record", seed=72),
    b=datasets.images("shards/train-00002*.array_record", seed=73),
    # a mixture whose weights change at step 5
    mix=datasets.scheduled({0: {"a": 0.5, "b": 0.5}, 5: {"a": 0.2, "b": 0.8}}),
    # evaluation mode: 1000 records, the last batch padded
    eval=datasets.images(seed=74, drop_remainder=False),
    # packed text: tokenize, chunk, first-fit pack, padded rows
    lm=datasets.packed_text(batch_fn=datasets.BATCH_AND_PAD, seed=75, num_epochs=0,
                            length=LENGTH),
    # packed text, one epoch, evaluation mode: the last batch padded
    lm_once=datasets.packed_text(seed=76, drop_remainder=False, length=LENGTH),
    fixed_mix=datasets.mixture(a=0.6, b=0.4),
    # packed "tokens" (pixels) over a mixture's records
    lm_mix=datasets.dataset(None, source="fixed_mix", pipeline="pixel_tokens:tokens",
                            iter_pipeline=datasets.PACK, batch_fn=datasets.BATCH_AND_PAD,
                            iter_options={"length": LENGTH, "num_packing_bins": 4}),
)

# lm_mix's pipeline: each image's first 1 + label % 40 pixels as "tokens"
# (documents of many lengths, from a mixture's components).
PIXEL_TOKENS = textwrap.dedent("""\
    import numpy as np

    def _tokens(e):
      return {"tokens": e["image"].reshape(-1)[:1 + int(e["label"]) % 40].astype(np.int32)}

    def tokens(ds):
      return ds.map(_tokens)
    """)


@pytest.fixture(scope="module")
def explain_config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = datasets.text_root(tmp_path_factory.mktemp("explain"), docs=40, seed=7,
                            vocab_size=384, images=data_dir)
  (root / "pixel_tokens.py").write_text(PIXEL_TOKENS)
  path = pathlib.Path(datasets.write_config(root / "elevator.toml", **DATASETS))
  # pixel_tokens, for embedded mode and an in-process server's workers (a
  # process started by the fork server takes this process's sys.path).
  sys.path.insert(0, str(root))
  yield path
  sys.path.remove(str(root))


@pytest.fixture(scope="module")
def explain_server(explain_config):
  """One in-process 2-worker server for the module: every test only reads."""
  with Server(str(explain_config), ServerOptions(port=0, workers=2)) as s:
    yield s


def _rebuilt(row: dict) -> dict:
  """The row an explanation names, made from its record alone."""
  raw = array_record_data_source.ArrayRecordDataSource([row["shard"]])[row["record"]]
  return examples.decode_images(grain.MapDataset.source([raw]), **IMAGE)[0]


def _served(target: str, name: str, step: int, h: int, n: int) -> dict:
  with RemoteDataset(target, name, G, shard_index=h, shard_count=n) as ds:
    it = iter(ds)
    it.skip(step)
    return next(it)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,steps", [("twice", (0, 83, 165)), ("mix", (0, 4, 5, 9)),
                                        ("eval", (0, EVAL_STEPS - 1))])
@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_the_named_records_rebuild_the_served_rows(explain_server, explain_config, name,
                                                   steps, hosts):
  for target in (explain_server.target, f"local:{explain_config}"):
    for step in steps:
      for h in range(hosts):
        explained = RemoteDataset(target, name, G, shard_index=h,
                                  shard_count=hosts).explain(step)
        served = _served(explain_server.target, name, step, h, hosts)
        assert json.loads(json.dumps(explained)) == explained
        assert explained["step"] == step and len(explained["rows"]) == G // hosts
        for i, row in enumerate(explained["rows"]):
          assert row["row"] == i and row["global_row"] == h * G // hosts + i
          if row.get("padding"):
            assert name == "eval" and not served[contract.MASK_KEY][i]
            assert not served["image"][i].any()
            continue
          if name == "eval":
            assert served[contract.MASK_KEY][i]
          if name == "twice":
            assert row["epoch"] == row["position"] // 1000
          if name == "mix":
            assert row["component"] in ("a", "b")
          want = _rebuilt(row)
          for key in ("id", "label", "image"):
            assert np.asarray(want[key]).tobytes() == served[key][i].tobytes(), (
                f"{name} step {step} host {h}/{hosts} row {i} {key}")


def test_the_last_eval_batch_has_padding_and_both_epochs_show(explain_server):
  last = RemoteDataset(explain_server.target, "eval", G).explain(EVAL_STEPS - 1)
  pads = [r for r in last["rows"] if r.get("padding")]
  assert len(pads) == EVAL_STEPS * G - 1000
  epochs = {r["epoch"] for r in RemoteDataset(explain_server.target, "twice", G).explain(83)["rows"]}
  assert epochs == {0, 1}


def test_bad_steps_get_precise_errors(explain_server, explain_config):
  for target in (explain_server.target, f"local:{explain_config}"):
    ds = RemoteDataset(target, "eval", G)
    with pytest.raises(EndOfDataError, match="past the end"):
      ds.explain(EVAL_STEPS)
    with pytest.raises(InvalidRequestError, match="step >= 0"):
      ds.explain(-1)
    with pytest.raises(InvalidRequestError, match="2\\*\\*63 - 1"):
      ds.explain(1 << 61)
    with pytest.raises(InvalidRequestError, match="passes the end of the stream"):
      RemoteDataset(target, "lm_once", G).explain(10_000)


def test_the_cli_explains_a_step(explain_server, explain_config, capsys):
  assert cli.main(["explain", str(explain_config), "mix", "-G", str(G), "--step", "6",
                   "--host", "1", "--hosts", "2", "--json"]) == 0
  local = json.loads(capsys.readouterr().out)
  assert cli.main(["explain", explain_server.target, "mix", "-G", str(G), "--step", "6",
                   "--host", "1", "--hosts", "2", "--json"]) == 0
  assert json.loads(capsys.readouterr().out) == local
  assert cli.main(["explain", explain_server.target, "eval", "-G", str(G), "--step",
                   str(EVAL_STEPS - 1)]) == 0
  text = capsys.readouterr().out
  assert "padding" in text and "record" in text
  assert cli.main(["explain", explain_server.target, "eval", "-G", str(G), "--step",
                   str(EVAL_STEPS)]) == 2
  assert "past the end" in capsys.readouterr().err
  assert cli.main(["explain", explain_server.target, "lm", "-G", str(G), "--step", "2"]) == 0
  assert "slots 0.." in capsys.readouterr().out


_steps: dict[tuple[str, str], tuple[list[tuple[dict, dict]], bool]] = {}


def _stream_steps(config: pathlib.Path, name: str, limit: int = 1000
                  ) -> list[tuple[dict, dict]]:
  """Embedded mode's (state where the step starts, batch) for each step, to
  the stream's end or `limit`; read once for the module's tests (to the
  longest limit asked), which only read them."""
  key = (str(config), name)
  got, ended = _steps.get(key, ([], False))
  if len(got) < limit and not ended:
    with RemoteDataset.embedded(str(config), name, G) as ds:
      it = iter(ds)
      got, ended = [], False
      while len(got) < limit:
        state = it.get_state()
        try:
          got.append((state, next(it)))
        except StopIteration:
          ended = True
          break
    _steps[key] = got, ended
  return got[:limit]


def _tokens(config: pathlib.Path, shard: str, record: int) -> np.ndarray:
  raw = array_record_data_source.ArrayRecordDataSource([shard])[record]
  ds = text.tokenize(grain.MapDataset.source([raw]),
                     tokenizer=str(config.parent / "tokenizer.json"), field="text")
  return ds[0]["tokens"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["lm", "lm_once"])
@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_the_named_segments_rebuild_the_packed_rows(explain_server, explain_config, name,
                                                    hosts):
  """Each row's segments, read from their records and tokenized, are the
  served row's tokens, slot for slot; the rest of the row is padding."""
  steps = _stream_steps(explain_config, name, 6 if name == "lm" else 1000)
  picks = [0, 5] if name == "lm" else [0, len(steps) - 1]  # lm_once: its padded end too
  for target in (explain_server.target, f"local:{explain_config}"):
    for step in picks:
      state, batch = steps[step]
      for h in range(hosts):
        ds = RemoteDataset(target, name, G, shard_index=h, shard_count=hosts)
        explained = ds.explain(step, stream_state=state["stream_state"])
        if h == 0 and step:  # found from the stream's start by the server: the same
          assert ds.explain(step)["rows"] == explained["rows"]
        assert explained["kind"] == "stream" and len(explained["rows"]) == G // hosts
        for i, row in enumerate(explained["rows"]):
          r = h * G // hosts + i
          assert row["global_row"] == r
          if row.get("padding"):
            assert name == "lm_once" and not batch[contract.MASK_KEY][r]
            assert not batch["tokens"][r].any()
            continue
          rebuilt = np.zeros(LENGTH, batch["tokens"].dtype)
          ids = np.zeros(LENGTH, batch["tokens_segment_ids"].dtype)
          for k, seg in enumerate(row["segments"]):
            at, n = seg["slot"], seg["length"]
            assert seg["position"] == seg["element"]  # the head is 1:1 over the records
            toks = _tokens(explain_config, seg["shard"], seg["record"])
            rebuilt[at:at + n] = toks[seg["token_offset"]:seg["token_offset"] + n]
            ids[at:at + n] = k + 1
          assert rebuilt.tobytes() == batch["tokens"][r].tobytes(), f"{name} {step} row {r}"
          assert ids.tobytes() == batch["tokens_segment_ids"][r].tobytes()
        if name == "lm_once" and step == len(steps) - 1 and hosts == 1:
          assert any(row.get("padding") for row in explained["rows"])


def test_a_summary_counts_what_explain_names_step_by_step(explain_server, explain_config):
  """`summary(START, END)` per component equals the rows of every step's
  explanation, counted; a 1:1 dataset's is its own; padding is apart."""
  for target in (explain_server.target, f"local:{explain_config}"):
    got = RemoteDataset(target, "mix", G).summary(3, 8)  # across the schedule's change at 5
    named: dict[str, int] = {}
    for step in range(3, 8):
      for row in RemoteDataset(target, "mix", G).explain(step)["rows"]:
        named[row["component"]] = named.get(row["component"], 0) + 1
    assert {k: v["records"] for k, v in got["components"].items()} == named
    assert got["records"] == 5 * G and got["steps"] == [3, 8]
    last = RemoteDataset(target, "eval", G).summary(0, EVAL_STEPS)
    assert last["records"] == 1000 and last["padding_rows"] == EVAL_STEPS * G - 1000
    assert last["components"] == {"eval": {"records": 1000, "share": 1.0}}
  with pytest.raises(EndOfDataError):
    RemoteDataset(explain_server.target, "eval", G).summary(0, EVAL_STEPS + 1)
  with pytest.raises(InvalidRequestError, match="start < end"):
    RemoteDataset(explain_server.target, "eval", G).summary(4, 4)


def _counted(explained: list[dict], name: str) -> dict[str, dict[str, int]]:
  """Steps' explanations counted per source: tokens, segments, documents
  (segments from a document's first token)."""
  out: dict[str, dict[str, int]] = {}
  for rows in explained:
    for row in rows:
      for seg in row.get("segments", ()):
        c = out.setdefault(seg.get("component", name),
                           {"tokens": 0, "segments": 0, "documents": 0})
        c["tokens"] += seg["length"]
        c["segments"] += 1
        c["documents"] += seg["token_offset"] == 0
  return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["lm", "lm_once", "lm_mix"])
def test_a_stream_summary_counts_what_explain_names_step_by_step(
    explain_server, explain_config, monkeypatch, name):
  """A stream's summary per source is its steps' explanations counted, by
  mixture component for a stream over a mixture; its tokens are the served
  batches' tokens; served, embedded, and in calls of two steps each
  (embedded, with the per-call bound made small) alike."""
  steps = _stream_steps(explain_config, name, 1000 if name == "lm_once" else 9)
  # lm_once: its last steps, to the padded end
  first, end = (len(steps) - 4, len(steps)) if name == "lm_once" else (3, 9)
  state = steps[first][0]["stream_state"]
  want = _counted([RemoteDataset(explain_server.target, name, G).explain(
      k, stream_state=steps[k][0]["stream_state"])["rows"] for k in range(first, end)], name)
  served_tokens = sum(int(np.count_nonzero(b["tokens_segment_ids"]))
                      for _, b in steps[first:end])
  padding = sum(int(np.count_nonzero(~b[contract.MASK_KEY].astype(bool)))
                for _, b in steps[first:end] if contract.MASK_KEY in b)
  got = {}
  for how in ("served", "embedded", "in calls"):
    if how == "in calls":
      from grain_elevator.proto import limits  # pylint: disable=g-import-not-at-top
      monkeypatch.setattr(limits, "MAX_STREAM_SUMMARY_ROWS", 2 * G)
    target = explain_server.target if how == "served" else f"local:{explain_config}"
    got[how] = RemoteDataset(target, name, G).summary(first, end, stream_state=state)
    counts = {k: {f: v[f] for f in ("tokens", "segments", "documents")}
              for k, v in got[how]["components"].items()}
    assert counts == want, how
    assert got[how]["tokens"] == served_tokens and got[how]["padding_rows"] == padding
    assert got[how]["rows"] == (end - first) * G - padding and got[how]["steps"] == [first, end]
    if end < len(steps):  # where the next step starts
      assert got[how]["next_stream_state"] == steps[end][0]["stream_state"]
  assert got["served"] == got["embedded"] == got["in calls"]
  if name == "lm_mix":
    assert sorted(want) == ["a", "b"]
    assert RemoteDataset(explain_server.target, name, G).summary(first, end) == got["served"]
    # One call over the bound, straight to the server: refused, naming it.
    backend = make_backend(explain_server.target)
    try:
      with pytest.raises(InvalidRequestError, match="MAX_STREAM_SUMMARY_ROWS"):
        backend.explain(pb.ExplainRequest(summary=True, request=pb.BatchRequest(
            dataset=name, global_batch_size=G, shard_count=1, num_steps=1 << 20,
            config_fingerprint=got["served"]["config_fingerprint"])))
    finally:
      backend.close()
  if name == "lm_once":  # past its end
    with pytest.raises(EndOfDataError, match="passes the end of the stream"):
      RemoteDataset(explain_server.target, name, G).summary(0, len(steps) + 1)


def test_the_cli_summary(explain_server, capsys):
  assert cli.main(["explain", explain_server.target, "mix", "-G", str(G),
                   "--summary", "0:10"]) == 0
  got = json.loads(capsys.readouterr().out)
  assert sum(c["records"] for c in got["components"].values()) == 10 * G
  assert cli.main(["explain", explain_server.target, "mix", "-G", str(G),
                   "--summary", "ten"]) == 2
  capsys.readouterr()
  assert cli.main(["explain", explain_server.target, "lm_mix", "-G", str(G),
                   "--summary", "0:3"]) == 0
  got = json.loads(capsys.readouterr().out)
  assert got["kind"] == "stream" and sorted(got["components"]) == ["a", "b"]


@pytest.mark.timeout(300)
def test_metrics_count_records_per_component_and_tokens(explain_config):
  """elevator_records_served{dataset,component} and elevator_tokens_served
  hold what the clients received, by mixture component."""
  from grain_elevator.tools import top  # pylint: disable=g-import-not-at-top
  with Server(str(explain_config), ServerOptions(port=0, workers=2, metrics_port=0)) as server:
    with RemoteDataset(server.target, "mix", G, prefetch=0) as ds:  # one step a request
      it = iter(ds)
      for _ in range(8):
        next(it)
    with RemoteDataset(server.target, "lm", G, shard_index=1, shard_count=2) as ds:
      it = iter(ds)
      tokens = sum(int(np.count_nonzero(next(it)["tokens_segment_ids"])) for _ in range(4))
    def scrape():
      return top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=60)
    wait_for(lambda: scrape()[("elevator_inflight_requests", ())] == 0, "the requests to end")
    m = scrape()
  want = RemoteDataset(f"local:{explain_config}", "mix", G).summary(0, 8)["components"]
  for name, c in want.items():
    key = ("elevator_records_served_total", (("component", name), ("dataset", "mix")))
    assert m[key] == c["records"]
  got = m[("elevator_tokens_served_total", (("component", "lm"), ("dataset", "lm")))]
  assert got >= tokens > 0  # its fetch thread may have read a chunk ahead
