"""StepShape in-process, on the conftest's datasets: a step dataset's steps,
made and encoded, against embedded mode and Grain's own records, and the
requests it refuses. No server process: the shape is built as a RequestPath
builds it (server/serving/request_path.py)."""

from __future__ import annotations

import numpy as np
import pytest

from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto import wire
from grain_elevator.proto.errors import EndOfDataError, InvalidRequestError
from grain_elevator.proto.limits import MAX_EXPLAIN_ROWS
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import records as records_lib
from grain_elevator.server.data.registry import Datasets
from grain_elevator.server.serving.batch_cache import BatchCache
from grain_elevator.server.serving.read_plan import ReadPlanner
from grain_elevator.server.serving.step_shape import StepShape
from helpers import assert_leaves_equal


@pytest.fixture(scope="module")
def datasets(config_path: str) -> Datasets:
  return Datasets(config_lib.load_config(config_path), open_now=False)


@pytest.fixture
def shape() -> StepShape:
  return StepShape(BatchCache(16 << 20), ReadPlanner())


def _request(name: str, g: int, h: int, n: int, start: int, num: int = 2,
             **fields) -> pb.BatchRequest:
  return pb.BatchRequest(dataset=name, global_batch_size=g, shard_index=h, shard_count=n,
                         start_step=start, num_steps=num, **fields)


def _always() -> bool:
  return True


# (dataset, G, h, H, first step): 1:1 with and without a shuffle, across
# an epoch's end (aug2 step 83: positions 996..1007), a whole-batch decode,
# a dataset repeating forever, raw bytes, evaluation mode's padded last step.
CASES = [("plain", 12, 0, 1, 0), ("aug2", 12, 1, 2, 82), ("seed3fast", 8, 3, 4, 5),
         ("forever", 16, 0, 2, 200), ("raw", 6, 2, 3, 40), ("eval", 12, 1, 3, 82)]


@pytest.mark.parametrize("name,g,h,n,start", CASES)
def test_steps_are_embedded_modes_bit_for_bit(datasets, shape, oracle, name, g, h, n, start):
  r = _request(name, g, h, n, start)
  ds = datasets.get(name)
  shape.check(ds, r)
  got = list(shape.steps(ds, r, _always))
  want = oracle.fetch(r)
  assert [s for s, _, _ in got] == [start, start + 1]
  assert [state for _, _, state in got] == ["", ""]  # a step dataset has no position
  for (step, leaves, _), expected in zip(got, want):
    assert_leaves_equal(leaves, expected.leaves, f"{name} step {step}")


@pytest.mark.parametrize("name,g,h,n,start", [c for c in CASES if c[0] != "eval"])
def test_steps_are_grains_own_records(datasets, shape, name, g, h, n, start):
  """The contract computed without the request path: Grain's seed, shuffle,
  repeat and pipeline, one record at a time, at the host's positions."""
  ds = datasets.get(name)
  records = records_lib.build_records(ds.config)
  r = _request(name, g, h, n, start)
  for step, leaves, _ in shape.steps(ds, r, _always):
    rows = [records[p] for p in contract.host_positions(step, g, h, n)]
    want = [np.stack(column) for column in zip(*(tree.flatten(row)[0] for row in rows))]
    assert_leaves_equal(leaves, want, f"{name} step {step}")


@pytest.mark.parametrize("compression", sorted(wire.COMPRESSIONS))
def test_encoded_steps_decode_to_the_made_steps_and_are_cached(datasets, shape, compression):
  ds = datasets.get("seed3")
  r = _request("seed3", 16, 1, 2, 7, num=3, compression=wire.COMPRESSIONS[compression])
  made = list(shape.steps(ds, r, _always))
  first = list(shape.encoded_steps(ds, r, _always))
  assert len(first) == 3 and len(shape.cache) == 3
  for (step, leaves, _), parts in zip(made, first):
    got_step, got_leaves, state, _ = wire.decode_batch_message(b"".join(bytes(p) for p in parts))
    assert (got_step, state) == (step, "")
    assert_leaves_equal(got_leaves, leaves, f"step {step}")
  again = list(shape.encoded_steps(ds, r, _always))
  assert all(a is b for a, b in zip(again, first))  # the cache's own parts
  other = _request("seed3", 16, 0, 2, 7, num=3, compression=wire.COMPRESSIONS[compression])
  assert not any(a is b for a, b in zip(shape.encoded_steps(ds, other, _always), first))


def test_a_client_that_goes_away_stops_the_steps(datasets, shape):
  ds = datasets.get("plain")
  asked = []

  def active() -> bool:
    asked.append(1)
    return len(asked) <= 2
  got = [s for s, _, _ in shape.steps(ds, _request("plain", 8, 0, 1, 10, num=5), active)]
  assert got == [10, 11]


def test_what_a_step_dataset_refuses(datasets, shape):
  ds = datasets.get("plain")  # 1000 records, one epoch
  with pytest.raises(InvalidRequestError, match="'plain' is not a stream dataset: "
                     "stream_state means nothing"):
    shape.check(ds, _request("plain", 8, 0, 1, 0, stream_state='{"next_index": 0}'))
  with pytest.raises(EndOfDataError, match=r"steps \[124, 126\) reach past the end: the "
                     "stream has 125 steps"):
    shape.check(ds, _request("plain", 8, 0, 1, 124))
  shape.check(datasets.get("eval"), _request("eval", 8, 0, 1, 124, num=1))  # padded, served
  with pytest.raises(InvalidRequestError, match="'plain' is not a stream dataset: a client "
                     "skips its steps in O\\(1\\)"):
    shape.skip(ds, _request("plain", 8, 0, 1, 0), _always)


def test_explain_names_the_hosts_positions_and_its_refusals_name_the_step(datasets, shape):
  ds = datasets.get("forever")
  explained = shape.explain(ds, _request("forever", 12, 2, 3, 90, num=1))
  positions = contract.host_positions(90, 12, 2, 3)
  assert [row["position"] for row in explained["rows"]] == list(positions)
  assert {row["epoch"] for row in explained["rows"]} == {p // 1000 for p in positions}
  g = MAX_EXPLAIN_ROWS + 1
  with pytest.raises(InvalidRequestError, match=f"dataset 'forever', step 3: dataset "
                     f"'forever': a host slice of {g} rows"):
    shape.explain(ds, _request("forever", g, 0, 1, 3, num=1))


def test_a_summary_counts_the_records_of_whole_steps(datasets, shape):
  summary = shape.summary(datasets.get("eval"), _request("eval", 12, 0, 1, 80, num=4), _always)
  assert summary["steps"] == [80, 84]
  assert summary["records"] == 1000 - 80 * 12 and summary["padding_rows"] == 84 * 12 - 1000
  assert summary["components"] == {"eval": {"records": 40, "share": 1.0}}
