"""Rollback-and-skip: `iterator.skip(n)` drops the next n global batches,
the cursor records the range, and a resume from any later checkpoint, on
any host count, continues the oracle's stream with those steps removed; for
1:1 datasets, mixtures and packed stream datasets, served and embedded."""

from __future__ import annotations

import json
import pathlib

import grpc
import numpy as np
import pytest

from grain_elevator.client import (InvalidRequestError, RemoteDataset, StreamMismatchError,
                                   TransportOptions)
from grain_elevator.client import checkpoint
from grain_elevator.client import state as state_lib
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import limits
from grain_elevator.tools import cli
import datasets
from helpers import assert_streams_equal

G = 4
AT, SKIP, SAVED = 100, 50, 120  # skip 50 at step 100, save after 120 batches given

DATASETS = dict(
    forever=datasets.images(seed=61, num_epochs=0),  # 1:1, shuffled, repeating
    once=datasets.images(seed=62),  # 1:1, one epoch of 1000 records: 250 steps of 4
    a=datasets.images("shards/train-00000*.array_record", seed=63, num_epochs=0),
    b=datasets.images("shards/train-00001*.array_record", seed=64, num_epochs=0),
    mix=datasets.mixture(a=0.7, b=0.3),  # a mixture of two 1:1 datasets
    # packed text: tokenize, chunk, first-fit pack
    lm=datasets.packed_text(batch_fn=datasets.BATCH_AND_PAD, seed=65, num_epochs=0),
    lm_once=datasets.packed_text(seed=66),  # packed text, one epoch: a finite stream
)

SHAPES = ("forever", "mix", "lm")


@pytest.fixture(scope="module")
def skip_config(data_dir: pathlib.Path, tmp_path_factory) -> pathlib.Path:
  root = datasets.text_root(tmp_path_factory.mktemp("skips"), docs=60, seed=5,
                            vocab_size=384, images=data_dir)
  return pathlib.Path(datasets.write_config(root / "elevator.toml", **DATASETS))


@pytest.fixture(scope="module")
def skip_server(serve, skip_config):
  """The session's in-process 2-worker server of the module's config (these
  tests only read from it)."""
  return serve(skip_config, workers=2)


_oracles: dict[tuple[str, str], list] = {}


def oracle(config: pathlib.Path, name: str, steps: int) -> list:
  """Embedded mode's first `steps` global batches, without any skip."""
  key = (str(config), name)
  if len(_oracles.get(key, ())) < steps:
    with RemoteDataset.embedded(str(config), name, G) as ds:
      it = iter(ds)
      _oracles[key] = [next(it) for _ in range(steps)]
  return _oracles[key][:steps]


def _rows(batch: dict, h: int, n: int) -> dict:
  return {k: v[h * G // n:(h + 1) * G // n] for k, v in batch.items()}


def _take(it, k: int) -> list:
  return [next(it) for _ in range(k)]


def _dataset(target: str, name: str, h: int = 0, n: int = 1) -> RemoteDataset:
  return RemoteDataset(target, name, G, shard_index=h, shard_count=n,
                       transport=TransportOptions(steps_per_request=8))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SHAPES)
def test_a_skip_saved_later_resumes_on_another_host_count(skip_server, skip_config, name):
  """Skip 50 at step 100, save after 120 batches given, resume on 2 hosts:
  the oracle's stream with steps 100-149 removed."""
  want = oracle(skip_config, name, AT + SKIP + (SAVED - AT) + 8)
  with _dataset(skip_server.target, name) as ds:
    it = iter(ds)
    assert_streams_equal(_take(it, AT), want[:AT])
    it.skip(SKIP)
    assert_streams_equal(_take(it, SAVED - AT), want[AT + SKIP:SAVED + SKIP])
    saved = json.loads(json.dumps(it.get_state()))
  assert saved["step"] == SAVED + SKIP and saved["skips"] == [[AT, AT + SKIP]]
  assert state_lib.trained_steps(saved) == SAVED
  for target in (skip_server.target, f"local:{skip_config}"):
    for h in (0, 1):
      with _dataset(target, name, h, 2) as ds:
        it = iter(ds)
        it.set_state(saved)
        assert it.get_state() == saved  # the skip stays recorded
        got = _take(it, 8)
      assert assert_streams_equal(got, [_rows(b, h, 2) for b in want[SAVED + SKIP:]]) == 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SHAPES)
def test_a_skip_written_into_a_saved_cursor_is_made_on_resume(skip_server, skip_config, name,
                                                              tmp_path, capsys):
  """`elevator cursor skip STATE --steps 50` on a state saved at step 100:
  restored on 4 hosts, each continues at step 150; the made skip is kept."""
  want = oracle(skip_config, name, AT + SKIP + 4)
  with _dataset(skip_server.target, name) as ds:
    it = iter(ds)
    _take(it, AT)
    state = it.get_state()
  path = tmp_path / "state.json"
  path.write_text(json.dumps(state))
  assert cli.main(["cursor", "skip", str(path), "--steps", str(SKIP)]) == 0
  assert json.loads(capsys.readouterr().out)["resumes_at_step"] == AT + SKIP
  edited = json.loads(path.read_text())
  assert edited["step"] == AT and edited["skips"][-1] == [AT, AT + SKIP]
  for h in range(4):
    with _dataset(skip_server.target, name, h, 4) as ds:
      it = iter(ds)
      it.set_state(edited)
      assert it.get_state()["step"] == AT + SKIP
      got = _take(it, 4)
    assert assert_streams_equal(got, [_rows(b, h, 4) for b in want[AT + SKIP:]]) == 4


def test_a_grain_checkpoint_directory_is_edited_for_every_host(tmp_path):
  """Every host's file of a Grain checkpoint item gets the same skip."""
  state = {"step": 7, "dataset": "forever", "global_batch_size": G, "seed": 61,
           "config_fingerprint": "f"}
  for i in range(2):
    (tmp_path / f"process_{i}-of-2.json").write_text(json.dumps(state))
  checkpoint.skip_saved(tmp_path, 3)
  assert checkpoint.load_state(tmp_path)["skips"] == [[7, 10]]
  checkpoint.skip_saved(tmp_path, 2)  # a second skip before the resume extends the first
  assert checkpoint.load_state(tmp_path)["skips"] == [[7, 12]]


def test_a_cursor_with_skips_of_another_stream_is_refused(skip_server):
  with _dataset(skip_server.target, "forever") as ds:
    it = iter(ds)
    next(it)
    it.skip(5)
    saved = json.loads(json.dumps(it.get_state()))
  with _dataset(skip_server.target, "mix") as ds:
    with pytest.raises(StreamMismatchError, match="dataset"):
      iter(ds).set_state(saved)


def test_bad_skips_get_precise_errors(skip_server):
  with _dataset(skip_server.target, "once") as ds:
    it = iter(ds)
    for bad, why in ((-1, "whole number of steps >= 0"), (1.5, "whole number"),
                     (1 << 62, "past 2\\*\\*63 - 1"), (251, "passes the end.*250 steps")):
      with pytest.raises(InvalidRequestError, match=why):
        it.skip(bad)
    first = next(it)  # nothing moved
    it.skip(248)
    assert it.get_state()["skips"] == [[1, 249]]
    next(it)
    with pytest.raises(StopIteration):
      next(it)
    saved = it.get_state()
  assert np.array_equal(first["image"], next(iter(_dataset(skip_server.target, "once")))["image"])
  with _dataset(skip_server.target, "once") as ds:
    it = iter(ds)
    for state, why in (({**saved, "skips": [[1, 300]], "step": 2}, "passes the end"),
                       ({**saved, "skips": [[5, 9]], "step": 2}, "ahead of the state's step"),
                       ({**saved, "skips": [[1, 3], [2, 4]]}, "does not come after"),
                       ({**saved, "skips": "1-3"}, "must be a list"),
                       ({**saved, "version": 3}, "newer grain-elevator")):
      with pytest.raises(InvalidRequestError, match=why):
        it.set_state(state)
    old = {k: v for k, v in saved.items() if k not in ("version", "skips")}
    it.set_state({**old, "step": 3})  # a cursor from before skips still loads
    assert it.get_state()["step"] == 3 and "skips" not in it.get_state()


@pytest.mark.timeout(300)
def test_a_skip_past_the_end_of_a_finite_stream_is_refused_and_moves_nothing(
    skip_server, skip_config):
  with RemoteDataset.embedded(str(skip_config), "lm_once", G) as ds:
    total = sum(1 for _ in iter(ds))
  want = oracle(skip_config, "lm_once", 3)
  with _dataset(skip_server.target, "lm_once") as ds:
    it = iter(ds)
    next(it)
    with pytest.raises(InvalidRequestError, match="passes the end of the stream"):
      it.skip(total)
    assert it.get_state()["step"] == 1
    assert_streams_equal(_take(it, 2), want[1:3])
    it.skip(total - 4)  # to the last step exactly
    next(it)
    with pytest.raises(StopIteration):
      next(it)


def test_one_skip_call_is_bounded_by_rows_and_the_client_splits_by_them(skip_server,
                                                                        skip_config):
  """The server refuses a Skip of more than MAX_SKIP_ROWS rows (steps times
  G), naming the limit, before computing any; the client splits a longer
  skip into calls of limits.skip_steps(G) steps, which the server takes.
  (Before the bound, a call of 65,536 steps took ~748 s of worker CPU at
  G=64.) Here: 1,025 steps of 4 rows, 2 calls, ~1.5 s on an idle core."""
  over = limits.skip_steps(G) + 1
  with grpc.insecure_channel(skip_server.target) as channel:
    with pytest.raises(grpc.RpcError) as info:
      pb_grpc.ElevatorStub(channel).Skip(pb.BatchRequest(
          dataset="lm", global_batch_size=G, shard_count=1, num_steps=over), timeout=60)
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert (f"a Skip computes at most {limits.MAX_SKIP_ROWS} rows per call (MAX_SKIP_ROWS), "
          f"{limits.skip_steps(G)} steps of G={G}; asked for {over} steps"
          in info.value.details())
  want = oracle(skip_config, "lm", 2)[1]
  with _dataset(skip_server.target, "lm") as ds:  # over the bound: in two calls
    it = iter(ds)
    it.skip(over)
    assert it.get_state()["step"] == over
    got = next(it)
  with RemoteDataset.embedded(str(skip_config), "lm", G) as ds:
    it = iter(ds)
    it.skip(over)
    want = next(it)
  assert_streams_equal([got], [want])


def test_a_stream_skip_written_into_a_state_is_bounded(skip_server, tmp_path, capsys):
  """`elevator cursor skip --steps 10**12` on a stream state (~2*10**9 Skip
  calls on restore) is refused naming MAX_STREAM_SKIP_ROWS, the file
  untouched; a hand-written state holding one is refused on load; a 1:1
  dataset's skip is arithmetic, and any that fits int64 is written."""
  with _dataset(skip_server.target, "lm") as ds:
    it = iter(ds)
    next(it)
    saved = it.get_state()
  path = tmp_path / "lm.json"
  path.write_text(json.dumps(saved))
  assert cli.main(["cursor", "skip", str(path), "--steps", str(10**12)]) == 2
  err = capsys.readouterr().err
  assert (f"a skip of {10**12} steps of G={G} is {4 * 10**12} rows, over the "
          f"{state_lib.MAX_STREAM_SKIP_ROWS} one skip may make (MAX_STREAM_SKIP_ROWS, "
          f"{state_lib.MAX_STREAM_SKIP_ROWS // G} steps of this G)") in err
  assert "Traceback" not in err and json.loads(path.read_text()) == saved
  most = state_lib.MAX_STREAM_SKIP_ROWS // G
  assert cli.main(["cursor", "skip", str(path), "--steps", str(most)]) == 0  # at the bound
  capsys.readouterr()
  assert cli.main(["cursor", "skip", str(path), "--steps", "1"]) == 2  # extends it past
  assert "MAX_STREAM_SKIP_ROWS" in capsys.readouterr().err
  with _dataset(skip_server.target, "lm") as ds:
    with pytest.raises(InvalidRequestError, match="MAX_STREAM_SKIP_ROWS"):
      iter(ds).set_state({**saved, "skips": [[1, 1 + most + 1]]})
  with _dataset(skip_server.target, "forever") as ds:
    it = iter(ds)
    next(it)
    path.write_text(json.dumps(it.get_state()))
  assert cli.main(["cursor", "skip", str(path), "--steps", str(10**12)]) == 0
  assert json.loads(capsys.readouterr().out)["resumes_at_step"] == 1 + 10**12


def test_a_state_file_nested_too_deep_gets_a_precise_error(skip_server, tmp_path, capsys):
  """A state file nested 100,000 deep (Python's json.loads: RecursionError)
  is refused naming the file and MAX_STATE_DEPTH, by `elevator cursor skip`,
  a checkpoint directory's load and `elevator explain --state`; a file over
  MAX_STATE_BYTES is refused before it is read whole."""
  deep = tmp_path / "deep.json"
  deep.write_text('{"step": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
  why = (f"state file {deep}: arrays and objects nested 100001 deep, over the "
         f"{state_lib.MAX_STATE_DEPTH} a saved state may nest (MAX_STATE_DEPTH)")
  assert cli.main(["cursor", "skip", str(deep), "--steps", "1"]) == 2
  err = capsys.readouterr().err
  assert why in err and "RecursionError" not in err
  assert cli.main(["explain", skip_server.target, "lm", "-G", str(G), "--step", "1",
                   "--state", str(deep)]) == 2
  err = capsys.readouterr().err
  assert why in err and "RecursionError" not in err
  item = tmp_path / "item"
  item.mkdir()
  (item / "process_0-of-1.json").write_text(deep.read_text())
  with pytest.raises(InvalidRequestError, match="MAX_STATE_DEPTH"):
    checkpoint.load_state(item)
  big = tmp_path / "big.json"
  big.write_text(" " * state_lib.MAX_STATE_BYTES + "{}")
  with pytest.raises(InvalidRequestError, match=f"state file {big}: over the "
                     f"{state_lib.MAX_STATE_BYTES} bytes .*MAX_STATE_BYTES"):
    state_lib.read(big)
  nested: dict = {}
  inner = nested
  for _ in range(state_lib.MAX_STATE_DEPTH + 1):  # a dict made in code, not parsed
    inner["parent"] = inner = {}
  with _dataset(skip_server.target, "lm") as ds:
    with pytest.raises(InvalidRequestError, match="MAX_STATE_DEPTH"):
      iter(ds).set_state({"step": 1, "dataset": "lm", "global_batch_size": G, "seed": 65,
                          "config_fingerprint": "f", "stream_state": nested})
