"""StreamShape in-process, on the conftest's "few" (a filter over the
images, forever) and a one-epoch twin: host rows and positions against
Grain's own pipeline and embedded mode, a request going on from a position,
a skip, the end of a stream, and what a stream dataset refuses. No server
process: the shape is built as a RequestPath builds it."""

from __future__ import annotations

import pathlib
import tomllib

import numpy as np
import pytest

from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import tree
from grain_elevator.proto import wire
from grain_elevator.proto.errors import EndOfDataError, InvalidRequestError
from grain_elevator.proto.limits import MAX_SKIP_STEPS
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data.registry import Datasets
from grain_elevator.server.serving.options import DEFAULT_MAX_STREAM_BATCH_BYTES
from grain_elevator.server.serving.stream_sessions import StreamSessions
from grain_elevator.server.serving.stream_shape import StreamShape
import datasets as datasets_lib
from helpers import assert_leaves_equal


@pytest.fixture(scope="module")
def few_once_config(few_config: str, tmp_path_factory: pytest.TempPathFactory) -> str:
  """"few" read once: a stream that ends (the conftest's table, its paths
  made absolute, with one epoch)."""
  few = tomllib.loads(pathlib.Path(few_config).read_text())["datasets"]["few"]
  paths = [str(pathlib.Path(few_config).parent / p) for p in few["paths"]]
  return datasets_lib.write_config(tmp_path_factory.mktemp("few-once") / "elevator.toml",
                                   few_once={**few, "paths": paths, "num_epochs": 1})


@pytest.fixture(scope="module")
def datasets(few_config: str, few_once_config: str) -> dict[str, object]:
  out = {}
  for path in (few_config, few_once_config):
    registry = Datasets(config_lib.load_config(path), open_now=False)
    out.update({name: registry.get(name) for name in registry.names})
  return out


@pytest.fixture(scope="module")
def few_oracle(few_config: str) -> EmbeddedBackend:
  return EmbeddedBackend(few_config)


@pytest.fixture
def shape() -> StreamShape:
  """As a server's: sessions shared by the hosts of a stream."""
  return StreamShape(StreamSessions(16 << 20), DEFAULT_MAX_STREAM_BATCH_BYTES)


def _request(g: int, h: int, n: int, start: int, num: int, state: str = "",
             name: str = "few", **fields) -> pb.BatchRequest:
  return pb.BatchRequest(dataset=name, global_batch_size=g, shard_index=h, shard_count=n,
                         start_step=start, num_steps=num, stream_state=state, **fields)


def _always() -> bool:
  return True


def _grains_own(ds, g: int, steps: int) -> list[tuple[list[np.ndarray], str]]:
  """The contract's pipeline for G, as Grain runs it in one process (the
  dataset's own head, no sessions): each global batch and the position after it."""
  it = iter(ds.pipeline(g))
  out = []
  for _ in range(steps):
    leaves = [np.asarray(a) for a in tree.flatten(next(it))[0]]
    out.append((leaves, contract.position_text(it.get_state())))
  return out


@pytest.mark.parametrize("g,hosts", [(8, 1), (12, 3), (16, 4)])
def test_each_host_gets_its_rows_of_grains_own_batches(datasets, shape, few_oracle, g, hosts):
  ds = datasets["few"]
  want = _grains_own(ds, g, 4)
  for h in range(hosts):
    r = _request(g, h, hosts, 0, 4)
    shape.check(ds, r)
    got = list(shape.steps(ds, r, _always))
    embedded = few_oracle.fetch(r)
    rows = contract.host_rows(g, h, hosts)
    assert [s for s, _, _ in got] == [0, 1, 2, 3]
    for (step, leaves, state), (batch, after), e in zip(got, want, embedded):
      where = f"G={g} host {h}/{hosts} step {step}"
      assert_leaves_equal(leaves, [a[rows.start:rows.stop] for a in batch], where)
      assert_leaves_equal(leaves, e.leaves, where)
      assert state == after == e.next_stream_state, where


def test_a_request_goes_on_from_the_position_it_names(datasets, shape):
  ds = datasets["few"]
  whole = list(shape.steps(ds, _request(12, 1, 2, 0, 6), _always))
  first = list(shape.steps(ds, _request(12, 1, 2, 0, 3), _always))
  rest = list(shape.steps(ds, _request(12, 1, 2, 3, 3, first[-1][2]), _always))
  assert [s for s, _, _ in first + rest] == list(range(6))
  for (step, leaves, state), (_, want, want_state) in zip(first + rest, whole):
    assert_leaves_equal(leaves, want, f"step {step}")
    assert state == want_state


def test_encoded_steps_carry_the_rows_and_the_position_after_each(datasets, shape):
  ds = datasets["few"]
  r = _request(16, 0, 2, 0, 3, compression=wire.COMPRESSION_ZSTD)
  for (step, leaves, state), parts in zip(shape.steps(ds, r, _always),
                                          shape.encoded_steps(ds, r, _always)):
    got_step, got, got_state, _ = wire.decode_batch_message(b"".join(bytes(p) for p in parts))
    assert (got_step, got_state) == (step, state)
    assert_leaves_equal(got, leaves, f"step {step}")


def test_a_skip_ends_where_the_steps_end(datasets, shape):
  ds = datasets["few"]
  states = [state for _, _, state in shape.steps(ds, _request(8, 0, 1, 0, 5), _always)]
  skipped = shape.skip(ds, _request(8, 0, 1, 0, 5), _always)
  assert (skipped.next_step, skipped.next_stream_state) == (5, states[-1])
  further = shape.skip(ds, _request(8, 0, 1, 2, 3, states[1]), _always)
  assert (further.next_step, further.next_stream_state) == (5, states[-1])
  with pytest.raises(InvalidRequestError, match=f"dataset 'few': a Skip moves at most "
                     f"{MAX_SKIP_STEPS} steps per call, asked for {MAX_SKIP_STEPS + 1}"):
    shape.skip(ds, _request(8, 0, 1, 0, MAX_SKIP_STEPS + 1), _always)


def test_a_finite_stream_serves_its_steps_then_says_it_ended(datasets, shape):
  ds = datasets["few_once"]
  length = sum(1 for _ in ds.pipeline(32))  # Grain's own count of whole batches
  got = []
  with pytest.raises(EndOfDataError, match=f"dataset 'few_once': the stream ends before "
                     f"step {length} \\(asked for steps up to {length + 9}\\)"):
    for step, _, _ in shape.steps(ds, _request(32, 0, 1, 0, length + 10, name="few_once"),
                                  _always):
      got.append(step)
  assert got == list(range(length))
  with pytest.raises(EndOfDataError, match="passes the end of the stream"):
    shape.skip(ds, _request(32, 0, 1, 0, length + 1, name="few_once"), _always)


def test_what_a_stream_dataset_refuses(datasets, shape):
  ds = datasets["few"]
  with pytest.raises(InvalidRequestError, match="'few' is a stream dataset: it continues "
                     "from stream_state, not from a record_offset \\(5\\)"):
    shape.check(ds, _request(8, 0, 1, 0, 1, record_offset=5))
  record_bytes = ds.info.element_spec.record_bytes
  small = StreamShape(StreamSessions(0), 8 * record_bytes)
  small.check(ds, _request(8, 0, 1, 0, 1))
  with pytest.raises(InvalidRequestError, match=f"9 rows of {record_bytes} bytes is "
                     f"{9 * record_bytes} bytes, over the server's --max-stream-batch-bytes"):
    small.check(ds, _request(9, 0, 1, 0, 1))
  with pytest.raises(InvalidRequestError, match="stream_state is not a position of this "
                     "stream"):
    list(shape.steps(ds, _request(8, 0, 1, 0, 1, '{"elsewhere": 1}'), _always))
  with pytest.raises(InvalidRequestError, match="dataset 'few', step 0 .*explain traces "
                     "token sequences"):
    shape.explain(ds, _request(8, 0, 1, 0, 1))
