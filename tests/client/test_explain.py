"""What step k held (`RemoteDataset.explain`, `elevator explain`), proved by
construction: read the records an explanation names, run the dataset's
pipeline on them, and rebuild the served rows bit for bit; for a 1:1
dataset over two epochs, a mixture and an evaluation run, served and
embedded, on 1, 2 and 4 hosts."""

from __future__ import annotations

import json
import pathlib
import textwrap

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.client import EndOfDataError, InvalidRequestError, RemoteDataset
from grain_elevator.pipelines import examples
from grain_elevator.proto import contract
from grain_elevator.tools import cli
from grain_elevator.tools.launcher import LocalServer

IMAGE = {"height": 4, "width": 4, "channels": 3}
G = 12  # 1000 records: the last evaluation batch has 8 padding rows

CONFIG = textwrap.dedent("""\
    [datasets.twice]         # 1:1, shuffled, two epochs
    paths = ["shards/*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 71
    num_epochs = 2
    [datasets.twice.options]
    height = 4
    width = 4
    channels = 3

    [datasets.a]
    paths = ["shards/train-00000*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 72
    [datasets.a.options]
    height = 4
    width = 4
    channels = 3
    [datasets.b]
    paths = ["shards/train-00002*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 73
    [datasets.b.options]
    height = 4
    width = 4
    channels = 3
    [datasets.mix]           # a mixture whose weights change at step 5
    [[datasets.mix.schedule]]
    step = 0
    weights = { a = 0.5, b = 0.5 }
    [[datasets.mix.schedule]]
    step = 5
    weights = { a = 0.2, b = 0.8 }

    [datasets.eval]          # evaluation mode: 1000 records, the last batch padded
    paths = ["shards/*.array_record"]
    pipeline = "grain_elevator.pipelines.examples:decode_images"
    seed = 74
    drop_remainder = false
    [datasets.eval.options]
    height = 4
    width = 4
    channels = 3
    """)

EVAL_STEPS = -(-1000 // G)  # the conftest's 1000 records


@pytest.fixture(scope="module")
def explain_config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("explain")
  (root / "shards").symlink_to(data_dir / "shards")
  (root / "elevator.toml").write_text(CONFIG)
  return root / "elevator.toml"


@pytest.fixture(scope="module")
def explain_server(explain_config):
  with LocalServer(str(explain_config), workers=2) as s:
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
