"""The client as a Grain citizen: composition, ending, closing, threads."""

from __future__ import annotations

import itertools
import threading

import grain
import numpy as np
import pytest

from grain_elevator.client import (ElevatorError, InvalidRequestError, RemoteDataset,
                                   RetryPolicy, Security, TransportOptions)
from helpers import assert_trees_equal, oracle_batch


def _our_threads() -> set[threading.Thread]:
  """The client's threads but the one closing thread a process keeps (client/closing.py)."""
  return {t for t in threading.enumerate()
          if t.name.startswith("grain-elevator") and t.name != "grain-elevator-closer"}


@pytest.fixture
def threads_before() -> set[threading.Thread]:
  """Fetch threads other tests' iterators may still hold (until collected)."""
  import gc
  gc.collect()
  return _our_threads()


def test_ends_cleanly_and_drops_the_final_partial_batch(server, threads_before):
  with RemoteDataset(server.target, "plain", 64) as ds:  # 1000 = 15*64 + 40
    batches = list(ds)
  assert len(batches) == 15
  ids = np.concatenate([b["id"] for b in batches])
  np.testing.assert_array_equal(ids, np.arange(960))  # no shuffle: records in order
  assert not _our_threads() - threads_before


def test_close_cancels_in_flight_requests_and_leaves_no_threads(server, threads_before):
  ds = RemoteDataset(server.target, "forever", 256, prefetch=16)
  it = iter(ds)
  next(it)
  assert _our_threads() - threads_before
  ds.close()
  assert not _our_threads() - threads_before
  with pytest.raises(ElevatorError, match="closed"):
    next(it)


def test_with_block_closes(server, threads_before):
  with RemoteDataset(server.target, "forever", 64, prefetch=4) as ds:
    it = iter(ds)
    next(it)
  assert not _our_threads() - threads_before


def test_composes_with_grain_transforms(server, oracle):
  """map, batch and thread prefetch on top; state still round-trips."""
  ds = RemoteDataset(server.target, "aug2", 32)
  ds = ds.map(lambda b: {"x": b["image"].astype(np.float32) / 255, "y": b["label"]})
  ds = ds.batch(2)
  ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=3)
  it = iter(ds)
  first = next(it)
  assert first["x"].shape == (2, 32, 4, 4, 3)
  expected = np.stack([oracle_batch(oracle, "aug2", k, 32)["label"] for k in (0, 1)])
  np.testing.assert_array_equal(first["y"], expected)
  state = it.get_state()
  second = next(it)
  it2 = iter(ds)
  it2.set_state(state)
  assert_trees_equal(next(it2), second)
  for i in (it, it2):
    i.close()


def test_device_put_yields_jax_arrays(server, oracle):
  import jax
  ds = grain.experimental.device_put(
      RemoteDataset(server.target, "seed3", 64), jax.devices()[0],
      cpu_buffer_size=2, device_buffer_size=2)
  it = iter(ds)
  batches = list(itertools.islice(it, 3))
  assert isinstance(batches[0]["image"], jax.Array)
  for k, b in enumerate(batches):
    # Without jax_enable_x64, int64 leaves land as int32, as jax.device_put does.
    expected = jax.tree.map(lambda x: np.asarray(jax.numpy.asarray(x)),
                            oracle_batch(oracle, "seed3", k, 64))
    assert_trees_equal(jax.tree.map(np.asarray, b), expected)


def test_embedded_target_forms_agree(config_path):
  a = list(itertools.islice(iter(RemoteDataset(f"local:{config_path}", "aug2", 96)), 3))
  b = list(itertools.islice(iter(RemoteDataset.embedded(config_path, "aug2", 96)), 3))
  for x, y in zip(a, b):
    assert_trees_equal(x, y)


def test_bad_arguments(server):
  with pytest.raises(ValueError, match="prefetch >= 0"):
    RemoteDataset(server.target, "plain", 8, prefetch=-1)
  with pytest.raises(ValueError, match="target must be"):
    RemoteDataset([], "plain", 8)
  for bad in ("127.0.0.1:", "localhost", "host:port", "h:70000"):
    with pytest.raises(ValueError, match="is not 'host:port'"):
      RemoteDataset(bad, "plain", 8)
  with pytest.raises(ValueError, match="cannot be mixed"):
    iter(RemoteDataset(["local:x.toml", server.target], "plain", 8))


@pytest.mark.parametrize("make,error,message", [
    (lambda: TransportOptions(kind="udp"), InvalidRequestError,
     "transport kind must be one of auto, grpc, bulk, got 'udp'"),
    (lambda: TransportOptions(compression="lz4"), InvalidRequestError,
     "compression must be one of"),
    (lambda: TransportOptions(connections_per_target=0), InvalidRequestError,
     "connections_per_target >= 1"),
    (lambda: RetryPolicy(timeout_s=0), InvalidRequestError,
     r"RetryPolicy.timeout_s must be > 0"),
    (lambda: RemoteDataset("h:1", "plain", 8, transport="grpc"), TypeError,
     r"transport must be a TransportOptions, e\.g\. transport=TransportOptions\(kind='grpc'\); got str 'grpc'"),
    (lambda: RemoteDataset("h:1", "plain", 8, transport=TransportOptions(kind="bulk"),
                           security=Security(root_certificates=b"pem")), InvalidRequestError,
     "the bulk transport is plaintext"),
])
def test_bad_options(make, error, message):
  """Bad arguments are InvalidRequestError: an ElevatorError and a ValueError."""
  with pytest.raises(error, match=message):
    make()


def test_unreachable_server_gives_a_clear_error():
  from grain_elevator.client import ServiceUnavailableError
  with pytest.raises(ServiceUnavailableError, match=r"no replica of 127.0.0.1:1 could serve Describe"):
    iter(RemoteDataset("127.0.0.1:1", "plain", 8, retry=RetryPolicy(timeout_s=1.0)))


def test_shard_arguments_come_in_pairs(server):
  with pytest.raises(ValueError, match="give both shard_index and shard_count"):
    RemoteDataset(server.target, "plain", 8, shard_count=2)


def test_close_from_another_thread_unblocks_a_waiting_next(config_path):
  """A trainer thread blocked in next() on a frozen server is released by close()."""
  import os
  import signal
  from grain_elevator.server import Server, ServerOptions
  # Its own server (its workers are frozen), in-process: its workers are
  # the ones signalled, never this process.
  with Server(config_path, ServerOptions(port=0, workers=1)) as server:
    ds = RemoteDataset(server.target, "plain", 8, prefetch=0)
    it = iter(ds)
    next(it)
    workers = server.worker_pids()
    for pid in workers:
      os.kill(pid, signal.SIGSTOP)
    try:
      errors = []

      def consume():
        try:
          next(it)
        except Exception as e:  # pylint: disable=broad-except
          errors.append(e)

      t = threading.Thread(target=consume)
      t.start()
      t.join(1.0)
      assert t.is_alive()  # waiting on the frozen worker
      ds.close()
      t.join(10)
      assert not t.is_alive()
      assert isinstance(errors[0], ElevatorError) and "closed" in str(errors[0])
    finally:
      for pid in workers:
        os.kill(pid, signal.SIGCONT)
