"""Mixtures and schedules against an independent oracle: Grain's own
`MapDataset.mix` over `MapDataset.range` components (which say which
component and index each record comes from), the offsets between segments
counted from the oracle's own picks; remote and embedded, H 1 and 2."""

from __future__ import annotations

import grain
import grpc
import numpy as np
import pytest

from grain_elevator.client import (ConfigError, InvalidRequestError, RemoteDataset,
                                   StreamMismatchError)
from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.proto import contract
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.tools.testing.launcher import LocalServer
import datasets
from helpers import assert_trees_equal, oracle_batch

pytestmark = pytest.mark.grain_contract  # run again on the lowest Grain admitted

G, BIG = 32, 10**12
# The two mixtures of mix_config: fixed weights, and weights that change at
# steps 2 and 4 (the last adds c and drops b).
MIXES = {
    "static": datasets.mixture(a=0.7, b=0.3),
    "scheduled": datasets.scheduled({0: {"a": 0.7, "b": 0.3}, 2: {"a": 0.2, "b": 0.8},
                                     4: {"a": 1, "b": 0, "c": 2}}),
}
SCHEDULES = {
    "static": [(0, {"a": 0.7, "b": 0.3})],
    "scheduled": [(0, {"a": 0.7, "b": 0.3}), (2, {"a": 0.2, "b": 0.8}),
                  (4, {"a": 1 / 3, "c": 2 / 3})],
}


def _components(shards: str) -> dict[str, dict]:
  """The mixtures' components a, b, c: the conftest's images, repeating forever."""
  return {n: datasets.images(f"{shards}/{g}", seed=s, num_epochs=0) for n, g, s in (
      ("a", "*.array_record", 1), ("b", "train-0000[0-1]*", 2), ("c", "*.array_record", 3))}


@pytest.fixture(scope="module")
def mix_config(data_dir, tmp_path_factory) -> str:
  return datasets.write_config(tmp_path_factory.mktemp("mix") / "elevator.toml",
                               **_components(f"{data_dir}/shards"), **MIXES)


@pytest.fixture(scope="module")
def mix_server(serve, mix_config):
  return serve(mix_config, workers=2)


def _oracle_picks(name: str, steps: int) -> list[tuple[str, int]]:
  """(component, index in its stream) of each record, from Grain's mix."""
  schedule = SCHEDULES[name]
  used = {"a": 0, "b": 0, "c": 0}
  picks: list[tuple[str, int]] = []
  for i, (start, weights) in enumerate(schedule):
    stop = schedule[i + 1][0] if i + 1 < len(schedule) else steps
    names = list(weights)
    mixed = grain.MapDataset.mix(
        [grain.MapDataset.range(j * BIG, (j + 1) * BIG) for j in range(len(names))],
        [weights[n] for n in names])
    segment = [(names[v // BIG], v % BIG) for v in (mixed[r] for r in range((stop - start) * G))]
    picks += [(c, used[c] + k) for c, k in segment]
    for c, _ in segment:
      used[c] += 1
  return picks


def _expected(oracle: EmbeddedBackend, name: str, steps: int, h: int, n: int):
  picks = _oracle_picks(name, steps)
  out = []
  for step in range(steps):
    rows = [oracle_batch(oracle, c, k, 1) for c, k in picks[step * G:(step + 1) * G]]
    rows = rows[h * G // n:(h + 1) * G // n]
    out.append({key: np.concatenate([r[key] for r in rows]) for key in rows[0]})
  return out


@pytest.mark.parametrize("name,steps", [("static", 3), ("scheduled", 6)])
@pytest.mark.parametrize("n", [1, 2])
def test_a_mixture_is_grains_mix_of_its_components(mix_server, mix_config, name, steps, n):
  oracle = EmbeddedBackend(mix_config)
  for h in range(n):
    want = _expected(oracle, name, steps, h, n)
    for ds in (RemoteDataset(mix_server.target, name, G, shard_index=h, shard_count=n),
               RemoteDataset.embedded(mix_config, name, G, shard_index=h, shard_count=n)):
      with ds:
        it = iter(ds)
        for step in range(steps):
          assert_trees_equal(next(it), want[step], f"{ds.targets[0][:6]} step {step}")


def test_resuming_a_scheduled_mixture_mid_segment(mix_server, mix_config):
  oracle = EmbeddedBackend(mix_config)
  want = _expected(oracle, "scheduled", 6, 0, 1)
  with RemoteDataset(mix_server.target, "scheduled", G) as ds:
    first = iter(ds)
    for _ in range(3):
      next(first)
    it = iter(ds)
    it.set_state(first.get_state())  # names segment 1's entries: steps 0-2 were read
    for step in (3, 4, 5):
      assert_trees_equal(next(it), want[step], f"step {step}")


@pytest.mark.parametrize("mix, message", [
    (datasets.mixture(a=0.5, nope=0.5), "unknown component 'nope'"),
    (datasets.mixture(a=-1, b=2), "weight of 'a' must be a finite number >= 0"),
    (datasets.mixture(a=0, b=0), "the weights are all zero"),
    ({**datasets.mixture(a=1), "seed": 3}, "a mixture has 'mixture' or 'schedule', not both"),
    ({"schedule": [{"step": 0, "weights": {"a": 1}}, {"step": 0, "weights": {"b": 1}}]},
     "schedule steps must increase: entry 1 has step 0 after 0"),
    (datasets.scheduled({5: {"a": 1}}), "the schedule must start at step 0"),
    (datasets.mixture(a=1, raw=1), "components 'a' and 'raw' have different element structure"),
])
def test_bad_mixtures_are_refused_at_start(data_dir, tmp_path, mix, message):
  config = datasets.write_config(tmp_path / "elevator.toml", **_components(f"{data_dir}/shards"),
                                 raw=datasets.raw(f"{data_dir}/shards/*.array_record"), bad=mix)
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    with RemoteDataset.embedded(config, "bad", G) as ds:
      next(iter(ds))


def _config(tmp_path, data_dir, name: str, schedule: dict[int, dict[str, float]]) -> str:
  return datasets.write_config(tmp_path / f"{name}.toml", **_components(f"{data_dir}/shards"),
                               m=datasets.scheduled(schedule))


def test_an_entry_added_after_a_checkpoint_keeps_it_valid(serve, data_dir, tmp_path):
  """Saved at step 3 under [0: a .7 b .3]; the operator adds an entry at step
  5 and restarts: the checkpoint resumes, steps 3-4 are what the old schedule
  gave, 5 on follow the new one. An entry at step 2 (already consumed) is refused."""
  old = _config(tmp_path, data_dir, "old", {0: {"a": 0.7, "b": 0.3}})
  new = _config(tmp_path, data_dir, "new", {0: {"a": 0.7, "b": 0.3}, 5: {"b": 1}})
  rewritten = _config(tmp_path, data_dir, "bad", {0: {"a": 0.7, "b": 0.3}, 2: {"b": 1}})
  with RemoteDataset.embedded(old, "m", G) as ds:
    it = iter(ds)
    for _ in range(3):
      next(it)
    saved = it.get_state()
    old_steps = [next(it) for _ in range(3)]  # steps 3, 4, 5 under the old schedule
  # A server started on the new config (in-process; embedded in the lowest-Grain pass).
  with RemoteDataset(serve(new).target, "m", G) as ds:
    it = iter(ds)
    it.set_state(saved)
    got = [next(it) for _ in range(3)]
  assert_trees_equal(got[0], old_steps[0], "step 3")
  assert_trees_equal(got[1], old_steps[1], "step 4")
  assert got[2]["id"].tobytes() != old_steps[2]["id"].tobytes()  # the new segment
  with RemoteDataset.embedded(rewritten, "m", G) as ds:
    it = iter(ds)
    with pytest.raises(StreamMismatchError, match="config_fingerprint: saved"):
      it.set_state(saved)


def test_the_period_table_matches_grains_function_record_by_record(monkeypatch):
  """Batches are located from one tabulated period of Grain's selection;
  a period too long to tabulate falls back to Grain's function per record."""
  from grain_elevator.server.data import mixture  # pylint: disable=import-outside-toplevel
  records = np.arange(0, 20_000, 7, dtype=np.int64)
  tabulated = mixture._Segment(0, (0, 2, 1), (250, 150, 100)).locate(records)
  monkeypatch.setattr(mixture, "_MAX_TABLE", 0)
  direct = mixture._Segment(0, (0, 2, 1), (250, 150, 100)).locate(records)
  np.testing.assert_array_equal(tabulated[0], direct[0])
  np.testing.assert_array_equal(tabulated[1], direct[1])
  mixed = grain.MapDataset.mix([grain.MapDataset.range(j * BIG, (j + 1) * BIG) for j in range(3)],
                               [0.5, 0.3, 0.2])
  want = [mixed[int(r)] for r in records]
  assert [(0, 2, 1)[v // BIG] for v in want] == tabulated[0].tolist()
  assert [v % BIG for v in want] == tabulated[1].tolist()


# A client's G against a schedule entry far out: step x G past what a stream
# can hold is INVALID_ARGUMENT naming the dataset and G, before any int64
# arithmetic can overflow (it was INTERNAL, an OverflowError).

LATE, FAR = 10**9, 2**62
LATE_MIXES = {
    "late": datasets.scheduled({0: {"a": 1}, LATE: {"b": 1}}),
    "far": datasets.scheduled({0: {"a": 0.5, "b": 0.5}, FAR: {"c": 1}}),
}
# (dataset, G, H, what the refusal says): G/H rows stay under the message size
# limit, so the mixture's own check answers; G = 2**62 is refused by that
# limit first, as for any dataset.
TOO_BIG = [
    ("late", 2**34, 2**20, f"global_batch_size {2**34} puts its schedule entry at step {LATE} "
     f"at record {LATE * 2**34}, past the last position a stream has "
     f"({contract.FOREVER_LENGTH}); use a global_batch_size of at most "
     f"{contract.FOREVER_LENGTH // LATE}"),
    ("far", 2, 1, f"global_batch_size 2 puts its schedule entry at step {FAR} at record "
     f"{2 * FAR}"),
    ("late", 2**62, 2**20, "bytes per step, over the server's --max-message-bytes"),
]


@pytest.fixture(scope="module")
def late_config(data_dir, tmp_path_factory) -> str:
  return datasets.write_config(tmp_path_factory.mktemp("late") / "elevator.toml",
                               **_components(f"{data_dir}/shards"), **LATE_MIXES)


def test_a_batch_size_that_overflows_the_schedule_is_invalid_not_internal(late_config):
  with LocalServer(late_config, workers=1) as server:
    with grpc.insecure_channel(server.target) as channel:
      stub = pb_grpc.ElevatorStub(channel)
      for name, g, n, message in TOO_BIG:
        request = pb.BatchRequest(dataset=name, global_batch_size=g, shard_index=n - 1,
                                  shard_count=n, start_step=0, num_steps=1)
        with pytest.raises(grpc.RpcError) as info:
          list(stub.GetBatches(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert f"dataset {name!r}" in info.value.details()
        assert message in info.value.details()
    for name, g, n, message in TOO_BIG:
      for ds in (RemoteDataset(server.target, name, g, shard_index=n - 1, shard_count=n),
                 RemoteDataset.embedded(late_config, name, g, shard_index=n - 1,
                                        shard_count=n)):
        with ds, pytest.raises(InvalidRequestError) as info:
          next(iter(ds))
        assert f"dataset {name!r}" in str(info.value) and message in str(info.value)
    # The server goes on serving, these datasets too at a G they can hold.
    for name, g in (("late", G), ("far", 1)):
      with RemoteDataset(server.target, name, g) as remote, \
          RemoteDataset.embedded(late_config, name, g) as embedded:
        assert_trees_equal(next(iter(remote)), next(iter(embedded)), name)
  assert server.proc.returncode == 0, server.stderr()
  assert "OverflowError" not in server.stderr()
