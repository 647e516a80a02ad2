"""A file a dataset's options name (a tokenizer, a table) is part of its
identity, as its shards are: recorded when the server starts, never mixed
into one stream once replaced. A worker that built its pipeline before the
change serves what it read then; a worker started after refuses the dataset
with FAILED_PRECONDITION naming the file, and serves the others; a server
started on the new file has a new fingerprint and refuses the old cursors.

On the code before this test (aeadf26), a restarted worker tokenized with the
new file under the old fingerprint: 91 of 240 steps differed.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import re
import shutil
import signal
import time
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, ShardChangedError, StreamMismatchError
from grain_elevator.proto.errors import ConfigError
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import wire
from grain_elevator.server.data import registry
from grain_elevator.server.data.config import load_config
from grain_elevator.server.data.shards import identity as shard_identity
from grain_elevator.server.data.shards import option_files
from grain_elevator.server.serving.request_path import RequestPath
from grain_elevator.tools import text_corpus
from grain_elevator.tools import tokenizer as tokenizer_lib
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools.testing.launcher import LocalServer
import datasets
from helpers import assert_streams_equal, worker_pids

G, STEPS = 8, 6


def _text_config(path: pathlib.Path, shards: pathlib.Path) -> str:
  """lm: text packed with the tokenizer beside the config (its field names
  no file: text/ is a folder); plain: images, no file named."""
  return datasets.write_config(path, lm=datasets.packed_text(seed=5, num_epochs=0),
                               plain=datasets.images(shards / "*.array_record"))


class Text:
  """A private text dataset with its tokenizer, and another tokenizer to
  put in its place."""

  def __init__(self, root: pathlib.Path, shards: pathlib.Path):
    text_corpus.write_jsonl_shards(str(root / "text"), 60, num_shards=2, seed=3)
    self.tokenizer = str(tokenizer_lib.train(root / "tokenizer.json", vocab_size=512))
    self.other = str(tokenizer_lib.train(root / "other" / "tokenizer.json", vocab_size=700))
    self.config = _text_config(root / "elevator.toml", shards)

  def stream(self, g: int = G) -> list[Any]:
    """The first STEPS global batches as embedded mode computes them now: the oracle."""
    with RemoteDataset.embedded(self.config, "lm", g) as ds:
      return list(itertools.islice(iter(ds), STEPS))

  def replace_tokenizer(self) -> None:
    """The other tokenizer renamed over this one (the atomic way)."""
    shutil.copyfile(self.other, self.tokenizer + ".new")
    os.rename(self.tokenizer + ".new", self.tokenizer)


@pytest.fixture
def text(tmp_path: pathlib.Path, data_dir: pathlib.Path) -> Text:
  return Text(tmp_path, data_dir / "shards")


def _structure(config: str, dataset: str) -> Any:
  (info,) = EmbeddedBackend(config).describe(dataset)
  return info.element_spec.structure


def _ask(target: str, g: int, structure: Any) -> tuple[int, Any]:
  """On a new connection (so any worker): (the worker's index, the first
  STEPS batches of "lm" for G = g, or the grpc.RpcError it got). The index
  comes from describing "plain", which every worker serves."""
  with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
    stub = pb_grpc.ElevatorStub(ch)
    worker = stub.Describe(pb.DescribeRequest(dataset="plain"), timeout=60).server.worker_index
    request = pb.BatchRequest(dataset="lm", global_batch_size=g, shard_index=0, shard_count=1,
                              start_step=0, num_steps=STEPS)
    try:
      batches = list(stub.GetBatches(request, timeout=60))
    except grpc.RpcError as e:
      return worker, e
    return worker, [wire.decode_batch(b.SerializeToString(), structure)[1] for b in batches]


def _ask_both_workers(server: LocalServer, g: int, structure: Any,
                      judge: Callable[[int, Any], None]) -> None:
  """Asks on new connections until both workers have answered (at least
  twice each), handing each answer to `judge(worker, answer)`."""
  seen: dict[int, int] = {}
  deadline = time.monotonic() + 90
  while len(seen) < 2 or min(seen.values()) < 2:
    assert time.monotonic() < deadline, f"in 90 s only workers {seen} answered:\n{server.stderr()}"
    worker, answer = _ask(server.target, g, structure)
    judge(worker, answer)
    seen[worker] = seen.get(worker, 0) + 1


def _differ(a: list[Any], b: list[Any]) -> bool:
  try:
    assert_streams_equal(a, b)
  except AssertionError:
    return True
  return False


def _brief(answer: Any) -> str:
  if isinstance(answer, grpc.RpcError):
    return f"{answer.code().name}: {answer.details()}"
  return f"{len(answer)} batches, the first's tokens {answer[0]['tokens'][0][:8]}..."


def _refused(answer: Any, path: str) -> bool:
  return (isinstance(answer, grpc.RpcError)
          and answer.code() == grpc.StatusCode.FAILED_PRECONDITION
          and f"file {path} (options.tokenizer) changed since the server started"
          in answer.details())


@pytest.mark.slow  # a worker killed and restarted
def test_a_worker_restarted_after_the_tokenizer_changed_refuses_it(text):
  expected = {g: text.stream(g) for g in (G, 2 * G)}
  structure = _structure(text.config, "lm")
  with LocalServer(text.config, workers=2) as server:

    def same(worker: int, answer: Any, g: int = G) -> None:
      assert not isinstance(answer, Exception), f"worker {worker}: {_brief(answer)}"
      assert_streams_equal(answer, expected[g])

    _ask_both_workers(server, G, structure, same)
    text.replace_tokenizer()
    assert _differ(text.stream(2 * G), expected[2 * G])  # the new file tokenizes otherwise
    # Both workers built their pipeline with the old file: they serve it,
    # as the fingerprint says, a G they had not served (a new iterator) too.
    _ask_both_workers(server, 2 * G, structure, lambda w, a: same(w, a, 2 * G))

    victim = worker_pids(server)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not (m := re.search(rf"worker (\d+) \(pid {victim}\)", server.stderr())):
      assert time.monotonic() < deadline, server.stderr()
      time.sleep(0.1)
    restarted = int(m.group(1))
    while not re.search(rf"worker {restarted} \(pid \d+\) is serving again", server.stderr()):
      assert time.monotonic() < deadline, server.stderr()
      time.sleep(0.1)

    def judge(worker: int, answer: Any) -> None:
      if worker == restarted:  # it found the new file: "lm" refused, "plain" served
        assert _refused(answer, text.tokenizer), f"worker {worker}: {_brief(answer)}"
      else:
        same(worker, answer)

    _ask_both_workers(server, G, structure, judge)
    # The refusal is logged once, by the restarted worker, naming the file.
    assert re.search(rf"elevator\[worker {restarted}\].*dataset 'lm' is refused: .*file "
                     rf"{re.escape(text.tokenizer)} \(options.tokenizer\) changed",
                     server.stderr()), server.stderr()


def _server(config: str) -> Server:
  """A private in-process server of one worker, started on the files as they are."""
  return Server(config, ServerOptions(port=0, workers=1))


def test_a_server_started_on_another_tokenizer_has_another_fingerprint(text):
  expected = text.stream()
  with _server(text.config) as server:
    with RemoteDataset(server.target, "lm", G) as ds:
      it = iter(ds)
      assert_streams_equal([next(it) for _ in range(2)], expected[:2])
      state = it.get_state()
  (before,) = EmbeddedBackend(text.config).describe("lm")
  assert state["config_fingerprint"] == before.config_fingerprint

  text.replace_tokenizer()
  changed = text.stream()  # embedded mode loads the new file, not a cached one
  assert _differ(changed, expected)
  with _server(text.config) as server:
    with RemoteDataset(server.target, "lm", G) as ds:
      it = iter(ds)
      assert it.get_state()["config_fingerprint"] != state["config_fingerprint"]
      with pytest.raises(StreamMismatchError, match="config_fingerprint: saved"):
        it.set_state(state)
      assert_streams_equal([next(it) for _ in range(STEPS)], changed)
      after = it.get_state()["config_fingerprint"]
  # The same bytes written anew (another mtime, ctime and inode): the
  # fingerprint covers the content, so it is the same.
  shutil.copyfile(text.tokenizer, text.tokenizer + ".copy")
  os.rename(text.tokenizer + ".copy", text.tokenizer)
  (again,) = EmbeddedBackend(text.config).describe("lm")
  assert again.config_fingerprint == after


# In process: a worker's view (Datasets given the supervisor's recording),
# for 1:1 datasets, a mixture's components, a stream over the mixture, and
# a file an iter_pipeline reads.

_TABLE_PIPELINE = '''
import numpy as np
from grain_elevator.pipelines import config_path, examples


def shifted(ds, *, table, height, width, channels):
  """decode_images, each label plus table[label] (a .npy file, read now)."""
  shift = np.load(config_path(table))
  def add(e):
    return {**e, "label": e["label"] + shift[int(e["label"])]}
  return examples.decode_images(ds, height=height, width=width, channels=channels).map(add)


def labels_only(ds, *, labels):
  """An iter_pipeline: each element's label plus the first row of a .npy file."""
  shift = np.load(config_path(labels))
  return ds.map(lambda e: {"label": np.asarray(e["label"] + shift[0], np.int64)})
'''



def _table_config(root: pathlib.Path, shards: pathlib.Path) -> str:
  images = shards / "*.array_record"
  return datasets.write_config(
      root / "elevator.toml",
      # 1:1, a table in its options
      one=datasets.images(images, pipeline="table_pipeline:shifted",
                          options={"table": "tables/shift.npy"}),
      other=datasets.images(images),  # 1:1, no file
      mix=datasets.mixture(one=0.5, other=0.5),
      # a stream over the mixture
      over_mix=datasets.dataset(None, source="mix",
                                pipeline="grain_elevator.pipelines.examples:only_labels",
                                options={"labels": [0, 2, 4]}),
      # a file only its iter_pipeline reads, named by an absolute path
      iter=datasets.images(images, iter_pipeline="table_pipeline:labels_only",
                           iter_options={"labels": f"{root}/tables/first.npy"}))


@pytest.fixture
def tables(tmp_path: pathlib.Path, data_dir: pathlib.Path, monkeypatch) -> pathlib.Path:
  (tmp_path / "table_pipeline.py").write_text(_TABLE_PIPELINE)
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / "tables").mkdir()
  np.save(tmp_path / "tables" / "shift.npy", np.arange(10) * 100)
  np.save(tmp_path / "tables" / "first.npy", np.asarray([1000]))
  return pathlib.Path(_table_config(tmp_path, data_dir / "shards"))


def _rewrite(path: pathlib.Path, values: np.ndarray) -> None:
  """New content for `path`, renamed over it."""
  np.save(str(path) + ".new.npy", values)
  os.rename(str(path) + ".new.npy", path)


def test_files_named_in_options_are_recorded_by_where_they_are_named(tables):
  config = load_config(tables)
  root = tables.parent
  assert option_files.named_files(config.datasets["one"]) == {str(root / "tables/shift.npy")}
  assert option_files.named_files(config.datasets["iter"]) == {str(root / "tables/first.npy")}
  assert option_files.named_files(config.datasets["other"]) == set()
  recorded = shard_identity.record_identities(config)
  assert sorted(recorded.files) == [str(root / "tables/first.npy"),
                                    str(root / "tables/shift.npy")]
  files = option_files.OptionFiles(config.datasets["one"], recorded.files)
  assert [(f.where, f.path) for f in files.files] == [
      ("options.table", str(root / "tables/shift.npy"))]


def test_a_changed_table_refuses_its_dataset_its_mixture_and_the_stream_over_it(tables):
  config = load_config(tables)
  recorded = shard_identity.record_identities(config)
  before = registry.Datasets(config, identities=recorded)
  fingerprints = {n: before.get(n).info.config_fingerprint for n in before.names}
  shift = tables.parent / "tables" / "shift.npy"
  _rewrite(shift, np.arange(10) * 7)
  # A worker started now, with the recording of the server's start.
  restarted = registry.Datasets(config, identities=recorded)
  for name in ("one", "mix", "over_mix"):
    for _ in range(2):  # every time
      with pytest.raises(ShardChangedError,
                         match=re.escape(f"file {shift} (options.table) changed since the "
                                         "server started (") + ".*inode"):
        restarted.get(name)
  for name in ("other", "iter"):  # no file of theirs changed
    assert restarted.get(name).info.config_fingerprint == fingerprints[name]
  assert sorted(restarted.opened()) == ["iter", "other"]
  # Describe of every dataset lists what this worker serves; by name, the refusal.
  path = RequestPath(restarted)
  with path.admitted(None) as ticket:
    assert [i.name for i in path.describe(ticket, pb.DescribeRequest())] == ["iter", "other"]
    with pytest.raises(ShardChangedError, match="options.table"):
      path.describe(ticket, pb.DescribeRequest(dataset="one"))
  # A server started now records the new file: new fingerprints where it is read.
  fresh = registry.Datasets(config, identities=shard_identity.record_identities(config))
  for name in before.names:
    changed = fresh.get(name).info.config_fingerprint != fingerprints[name]
    assert changed == (name in ("one", "mix", "over_mix")), name


def test_an_iter_options_file_is_checked_each_time_the_iter_pipeline_is_built(tables):
  config = load_config(tables)
  opened = registry.Datasets(config, identities=shard_identity.record_identities(config))
  ds = opened.get("iter")
  (batch, _), = itertools.islice(ds.batches(4, ""), 1)
  assert int(batch[0][0]) >= 1000
  first = tables.parent / "tables" / "first.npy"
  _rewrite(first, np.asarray([2000]))
  # A new position, G or session builds the iter_pipeline again, which would
  # read the new file: refused, in this worker too.
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"file {first} (iter_options.labels) changed")):
    next(ds.batches(4, ""))


def test_a_string_that_names_a_file_only_now_is_refused(tables):
  config = load_config(tables)
  recorded = shard_identity.record_identities(config)
  (tables.parent / "text").write_text("")  # nothing was called "text" at start
  config.datasets["other"].options["field"] = "text"  # as if the config said so
  with pytest.raises(ShardChangedError,
                     match=re.escape(f"file {tables.parent / 'text'} (options.field) was not "
                                     "a file when the server started")):
    registry.Datasets(config, identities=recorded).get("other")


def test_a_files_identity_hashes_every_byte(tmp_path):
  path = tmp_path / "big"
  content = np.random.default_rng(0).bytes(3 * option_files.HASH_READ_BYTES + 5)
  path.write_bytes(content)
  identity = option_files.file_identity(str(path))
  assert identity.size == len(content)
  assert identity.content_hash == hashlib.blake2b(content, digest_size=16).hexdigest()
  with pytest.raises(ConfigError, match=re.escape(f"file {tmp_path / 'absent'} cannot be "
                                                  "opened")):
    option_files.file_identity(str(tmp_path / "absent"))
