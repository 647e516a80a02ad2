"""A replica whose every request slot is taken answers RESOURCE_EXHAUSTED:
the client takes that as "full right now" and retries on another replica,
or over gRPC where there is no other (the request came over bulk). The
stream stays exact, and one warning, not one per request, says so."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

import grpc

from grain_elevator.client import RemoteDataset
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.server import Server, ServerOptions
from helpers import assert_streams_equal

ENDLESS = pb.BatchRequest(dataset="forever", global_batch_size=256, shard_count=1,
                          start_step=0, num_steps=1_000_000)
# Under the server's limits on a stream that holds a slot unread (yields to
# a newcomer after 1 s without reading or 2 s streaming: server/serving/admission.py).
HOLD_S = 0.6
FULL = "is full (RESOURCE_EXHAUSTED"


@contextlib.contextmanager
def _every_slot_held(server: Server,
                     count: Callable[[], int] | None = None) -> Iterator[None]:
  """A hostile client keeps the one request slot of `server` (started with
  max_concurrent_requests=1) taken until the block ends, or with `count`,
  until count() has grown past what it was when the hold began: an endless
  stream it does not read, renewed before admission would hand the slot to
  a newcomer."""
  stop, held = threading.Event(), threading.Event()
  since: list[int] = []

  def done() -> bool:
    return count is not None and bool(since) and count() > since[0]

  def hold() -> None:
    with grpc.insecure_channel(server.target,
                               options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
      get_batches = pb_grpc.ElevatorStub(channel).GetBatches
      while not stop.is_set() and not done():
        call = get_batches(ENDLESS, timeout=30)
        try:
          next(call)  # admitted: it holds the slot
          if not held.is_set():
            since.append(count() if count is not None else 0)
            held.set()
          stop.wait(HOLD_S)
        except grpc.RpcError:
          time.sleep(0.005)  # refused: the slot is not free yet
        finally:
          call.cancel()

  thread = threading.Thread(target=hold, daemon=True)
  thread.start()
  assert held.wait(30), "the hostile client never got the slot"
  try:
    yield
  finally:
    stop.set()
    thread.join(30)


def _full_server(config_path: str) -> Server:
  """A replica of one worker and one request slot: in-process, and each
  test's own (its slot and its batch cache see no other test's reads)."""
  return Server(config_path, ServerOptions(port=0, workers=1, max_concurrent_requests=1))


def _warnings(caplog, text: str) -> list[str]:
  return [r.getMessage() for r in caplog.records
          if r.name == "grain_elevator.client" and r.levelno == logging.WARNING
          and FULL in r.getMessage() and text in r.getMessage()]


def test_a_full_replica_is_left_for_another(server, config_path, grain_elevator_logs):
  caplog = grain_elevator_logs
  with _full_server(config_path) as full:
    with RemoteDataset([full.target, server.target], "aug2", 8) as remote, \
         RemoteDataset.embedded(config_path, "aug2", 8) as local:
      it = iter(remote)  # connected to both while they have room
      with _every_slot_held(full):
        started = time.monotonic()
        got = list(it)
        took = time.monotonic() - started
      assert assert_streams_equal(got, local) == 250
  moved = _warnings(caplog, "retrying on another replica")
  assert any(full.target in m and "dataset 'aug2'" in m for m in moved), caplog.text
  # Rate-limited: one line per 10 s for the same replica and move.
  assert len(moved) <= 1 + took // 10, moved


def test_the_only_replica_full_over_bulk_is_retried_over_grpc(config_path, grain_elevator_logs):
  caplog = grain_elevator_logs
  with _full_server(config_path) as full:
    with RemoteDataset(full.target, "aug2", 8) as remote, \
         RemoteDataset.embedded(config_path, "aug2", 8) as local:
      it = iter(remote)
      got = [next(it) for _ in range(20)]
      assert it._backend.uses_bulk  # pylint: disable=protected-access
      # Held until the client, refused over bulk, has moved a request to gRPC
      # (and is refused there too), then let go: it gets in, within its timeout.
      with _every_slot_held(full, count=lambda: it.stats().fallbacks):
        got += list(it)
      assert assert_streams_equal(got, local) == 250
      stats = it.stats()  # what the trainer's author sees of it
      assert stats.retries >= 1 and stats.fallbacks >= 1, stats
  assert _warnings(caplog, "retrying over gRPC"), caplog.text
