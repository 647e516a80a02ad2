"""provenance.py in-process: what `elevator explain` says a step held,
checked against the rows themselves. A row named by its shard and record is
rebuilt from that record alone; a stream's traced segments are found in the
served tokens and in the elements that made them; summaries agree with the
explanations of the same steps. No server process."""

from __future__ import annotations

import collections
import pathlib
import sys
import textwrap
from typing import Any, Iterator

import grain
import numpy as np
import pytest
from array_record.python import array_record_data_source

from grain_elevator.pipelines import examples
from grain_elevator.proto import contract
from grain_elevator.proto import tree
from grain_elevator.proto.errors import Cancelled, InvalidRequestError
from grain_elevator.proto.limits import MAX_EXPLAIN_ROWS
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import provenance
from grain_elevator.server.data.registry import Datasets
import datasets as configs

IMAGE = {"height": 4, "width": 4, "channels": 3}  # the conftest's shards


def _config(path: pathlib.Path, shards: pathlib.Path) -> str:
  """This module's datasets over the conftest's shards (`datasets` here is
  the fixture of opened datasets, so the builder is `configs`)."""
  return configs.write_config(
      path,
      a=configs.images(shards / "train-00000*.array_record", seed=72),
      b=configs.images(shards / "train-00002*.array_record", seed=73),
      # a mixture whose weights change at step 2
      mix=configs.scheduled({0: {"a": 0.5, "b": 0.5}, 2: {"a": 0.2, "b": 0.8}}),
      # each image's first 1 + label pixels as tokens, packed
      tok=configs.dataset(shards / "*.array_record", pipeline="provenance_tokens:tokens",
                          iter_pipeline=configs.PACK, batch_fn=configs.BATCH_AND_PAD,
                          seed=9, num_epochs=0,
                          iter_options={"length": 16, "num_packing_bins": 4}),
      # the same tokens cut in chunks of 4, then first-fit packed into rows of 16:
      # a row may hold two chunks of one document side by side
      chunked=configs.dataset(shards / "*.array_record",
                              pipeline="provenance_tokens:tokens",
                              iter_pipeline="provenance_tokens:chunk_then_pack",
                              batch_fn=configs.BATCH_AND_PAD, seed=9, num_epochs=0))


TOKENS = textwrap.dedent("""\
    import numpy as np
    from grain_elevator.pipelines import examples

    def tokens(ds):
      return examples.decode_images(ds, height=4, width=4, channels=3).map(_tokens)

    def _tokens(e):
      return {"tokens": e["image"].reshape(-1)[:1 + int(e["label"])].astype(np.int32)}

    def chunk_then_pack(ds):
      from grain_elevator.pipelines import text
      return text.pack(text.chunk(ds, length=4), length=16, num_packing_bins=4)
    """)


@pytest.fixture(scope="module")
def datasets(config_path: str, data_dir: pathlib.Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
  """The conftest's datasets and this module's, opened in-process."""
  root = tmp_path_factory.mktemp("provenance")
  (root / "provenance_tokens.py").write_text(TOKENS)
  _config(root / "elevator.toml", data_dir / "shards")
  sys.path.insert(0, str(root))
  try:
    out = {}
    for path in (config_path, root / "elevator.toml"):
      registry = Datasets(config_lib.load_config(str(path)), open_now=False)
      out.update({name: registry.get(name) for name in registry.names})
    yield out
  finally:
    sys.path.remove(str(root))


def _rebuilt(origin: dict[str, Any]) -> dict[str, Any]:
  """The row an origin names, made from its record alone."""
  raw = array_record_data_source.ArrayRecordDataSource([origin["shard"]])[origin["record"]]
  return examples.decode_images(grain.MapDataset.source([raw]), **IMAGE)[0]


def _served(ds: Any, step: int, g: int, h: int, n: int) -> dict[str, np.ndarray]:
  leaves = ds.host_batch_leaves(step, g, h, n)
  return tree.unflatten(ds.info.element_spec.structure, leaves)


@pytest.mark.parametrize("name,step,g,h,n", [
    ("forever", 90, 12, 2, 3),  # positions 1080..1083: epoch 1
    ("mix", 1, 10, 0, 1), ("mix", 3, 10, 1, 2),  # both sides of the schedule's change
])
def test_each_named_record_rebuilds_its_served_row(datasets, name, step, g, h, n):
  ds = datasets[name]
  explained = provenance.explain(ds, step, g, h, n)
  served = _served(ds, step, g, h, n)
  positions = contract.host_positions(step, g, h, n)
  assert explained["kind"] == ("mixture" if name == "mix" else "records")
  assert len(explained["rows"]) == len(positions)
  for i, (row, p) in enumerate(zip(explained["rows"], positions)):
    assert (row["row"], row["global_row"], row["position"]) == (i, h * g // n + i, p)
    if name == "mix":
      assert row["component"] in ("a", "b")
      component = ds.components[ds.names.index(row["component"])]  # read forever
      assert row["epoch"] == row["component_position"] // component.info.num_records
    else:
      assert row["epoch"] == p // 1000
    want = _rebuilt(row)
    for key in ("id", "label", "image"):
      assert np.asarray(want[key]).tobytes() == served[key][i].tobytes(), f"row {i} {key}"


def test_evaluation_modes_padding_is_named_as_such(datasets):
  ds = datasets["eval"]  # 1000 records: step 83 of 12 holds 4, then 8 rows of padding
  rows = provenance.explain(ds, 83, 12, 0, 1)["rows"]
  assert [r.get("padding", False) for r in rows] == [False] * 4 + [True] * 8
  assert [r["position"] for r in rows] == list(range(996, 1008))
  counted = provenance.summary(ds, 82, 2, 12)
  assert (counted["records"], counted["padding_rows"]) == (16, 8)


def test_an_explanation_too_long_is_refused_with_the_hosts_that_fit(datasets):
  g = 2 * MAX_EXPLAIN_ROWS + 1
  with pytest.raises(InvalidRequestError, match=f"a host slice of {g} rows is more than "
                     f"one explanation holds .*--hosts 3 or more"):
    provenance.explain(datasets["forever"], 0, g, 0, 1)


def test_a_mixtures_summary_counts_what_its_explanations_name(datasets):
  ds = datasets["mix"]
  named = collections.Counter(
      row["component"] for step in range(4) for row in provenance.explain(ds, step, 10, 0, 1)[
          "rows"])
  summary = provenance.summary(ds, 0, 4, 10)
  assert {name: c["records"] for name, c in summary["components"].items()} == dict(named)
  assert summary["records"] == 40 and named["b"] > named["a"]  # 0.5/0.5, then 0.2/0.8
  assert provenance.counts(ds, 0, 40, 10) == dict(named)


def _stream_steps(ds: Any, g: int, num: int) -> list[tuple[str, list[np.ndarray]]]:
  """(the position where each step starts, its served leaves)."""
  out, position = [], ds.info.stream_start
  for leaves, after in ds.batches(g, position):
    out.append((position, leaves))
    position = after
    if len(out) == num:
      return out
  raise AssertionError("the stream ended")


def test_a_streams_segments_are_the_tokens_served_and_their_records(datasets):
  ds = datasets["tok"]
  paths = [l.path for l in ds.info.element_spec.leaves]
  for step, (position, leaves) in enumerate(_stream_steps(ds, 8, 3)):
    tokens = leaves[paths.index("tokens")]
    for h in range(2):
      explained = provenance.explain_stream(ds, 8, h, 2, step, position)
      assert (explained["stream_state"], explained["traced_leaf"]) == (position, "tokens")
      for row in explained["rows"]:
        served = tokens[row["global_row"]]
        covered = 0
        for s in row["segments"]:
          element = ds.head[s["element"]]["tokens"]
          got = served[s["slot"]:s["slot"] + s["length"]]
          assert got.tobytes() == element[s["token_offset"]:s["token_offset"] +
                                          s["length"]].tobytes()
          rebuilt = _rebuilt(s)["image"].reshape(-1)[:len(element)].astype(np.int32)
          assert rebuilt.tobytes() == element.tobytes()  # the element's record
          assert s["position"] == s["element"]  # the pipeline keeps the length
          covered += s["length"]
        assert covered == np.count_nonzero(leaves[paths.index("tokens_segment_ids")][
            row["global_row"]])


def test_a_streams_summary_adds_up_its_steps_explanations(datasets):
  ds = datasets["tok"]
  steps = _stream_steps(ds, 8, 4)
  segments = [s for step, (position, _) in enumerate(steps[:3]) for row in
              provenance.explain_stream(ds, 8, 0, 1, step, position)["rows"]
              for s in row["segments"]]
  summary = provenance.summary_stream(ds, 0, 3, 8, ds.info.stream_start)
  ids = [l.path for l in ds.info.element_spec.leaves].index("tokens_segment_ids")
  assert summary["next_stream_state"] == steps[3][0]
  assert summary["tokens"] == sum(np.count_nonzero(leaves[ids]) for _, leaves in steps[:3])
  assert summary["components"] == {"tok": {
      "tokens": summary["tokens"], "segments": len(segments),
      "documents": sum(s["token_offset"] == 0 for s in segments), "share": 1.0}}


def test_two_chunks_of_one_document_in_a_row_are_two_segments(datasets):
  """Each segment explain lists is one segment id's run of the served row,
  and every id is listed: chunks of one document packed side by side (their
  codes consecutive) are two segments, each with its own offset and length.
  The summary counts those segments; documents where their first token is."""
  ds = datasets["chunked"]
  paths = [l.path for l in ds.info.element_spec.leaves]
  steps = _stream_steps(ds, 8, 3)
  adjacent = 0  # rows where one element's chunks sit side by side
  listed = []
  for step, (position, leaves) in enumerate(steps):
    explained = provenance.explain_stream(ds, 8, 0, 1, step, position)
    for row in explained["rows"]:
      ids = leaves[paths.index("tokens_segment_ids")][row["global_row"]]
      tokens = leaves[paths.index("tokens")][row["global_row"]]
      segments = row["segments"]
      listed += segments
      assert [s["slot"] for s in segments] == [
          i for i in range(len(ids)) if ids[i] and (i == 0 or ids[i] != ids[i - 1])]
      for s in segments:
        run = ids[s["slot"]:s["slot"] + s["length"]]
        assert run.min() == run.max() > 0 and np.count_nonzero(ids == run[0]) == s["length"]
        element = ds.head[s["element"]]["tokens"]
        assert s["length"] <= 4 and s["token_offset"] % 4 == 0  # one chunk each
        assert tokens[s["slot"]:s["slot"] + s["length"]].tobytes() == element[
            s["token_offset"]:s["token_offset"] + s["length"]].tobytes()
      adjacent += sum(a["element"] == b["element"] and a["slot"] + a["length"] == b["slot"]
                      and a["token_offset"] + a["length"] == b["token_offset"]
                      for a, b in zip(segments, segments[1:]))
  assert adjacent > 0, "no row holds two chunks of one document side by side"
  summary = provenance.summary_stream(ds, 0, 3, 8, ds.info.stream_start)
  assert summary["components"]["chunked"]["segments"] == len(listed)
  assert summary["components"]["chunked"]["documents"] == sum(
      s["token_offset"] == 0 for s in listed)


def test_a_summary_stops_at_the_first_check_that_says_its_request_went(datasets):
  """A step summary counts in chunks of provenance._CHUNK positions and
  checks its request before each: a request gone at the 3rd check counts no
  3rd chunk. (Served, a mixture summary of 2**28 rows went on 12.1 s past
  its client's deadline; the request path checks gRPC's is_active.)"""
  ds = datasets["mix"]
  g = 10
  steps = 5 * provenance._CHUNK // g  # 5 chunks
  checks = []

  def check() -> None:
    checks.append(None)
    if len(checks) == 3:
      raise Cancelled("gone")

  with pytest.raises(Cancelled):
    provenance.summary(ds, 0, steps, g, check=check)
  assert len(checks) == 3
  assert provenance.summary(ds, 0, steps, g)["records"] == steps * g  # unchecked: whole
