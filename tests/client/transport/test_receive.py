"""A bulk step is read straight into its leaves' arrays, each aligned, and
anything but the encoder's exact bytes goes to the general decoder whole."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.client.transport import receive
from grain_elevator.client.transport.buffers import PAGE, BufferPool
from grain_elevator.proto import wire
from grain_elevator.proto.spec import LeafSpec
from helpers import assert_trees_equal, oracle_batch

LEAVES = [np.arange(300, dtype=np.int64), np.zeros((0, 5), np.int64),
          np.arange(256 * 300, dtype=np.float32).reshape(256, 100, 3),
          np.array([b"ab", b"cd"], "S2")]
SPEC = tuple(LeafSpec(str(i), a.dtype, a.shape) for i, a in enumerate(LEAVES))


def _receive(data: bytes, step: int):
  a, b = socket.socketpair()
  with a, b:
    sender = threading.Thread(target=a.sendall, args=(data,))
    sender.start()
    got = receive.receive_step(b, len(data), step, wire.layout_of(SPEC), BufferPool().take)
    sender.join()
  return got


@pytest.mark.parametrize("step,state,production_us", [
    (0, "", 0), (1, "", 0), (2**40 + 3, "a position ✓", 0), (5, "", 190_000),
    (6, "pos", 2**40)])
def test_the_encoders_bytes_land_in_aligned_leaves(step, state, production_us):
  """A production time after the leaves (and the position) is read with them."""
  data = (wire.encode_batch_bytes(step, LEAVES, next_stream_state=state)
          + wire.production_field(production_us))
  got = _receive(data, step)
  assert isinstance(got, tuple)
  leaves, got_state, got_us = got
  assert (got_state, got_us) == (state, production_us)
  assert_trees_equal(leaves, LEAVES)
  for leaf in leaves:
    address = leaf.__array_interface__["data"][0]
    assert address % receive.ALIGN == 0
    if leaf.nbytes >= receive.PAGE_ALIGN_BYTES:
      assert address % PAGE == 0


@pytest.mark.parametrize("where", [0, 1, 3, 9, 14, -5, -4])
def test_other_bytes_are_handed_on_whole_for_the_decoder(where):
  """A byte off in the step's tag or value, a leaf's length, dtype or shape, the
  position's tag or length: the payload comes back in order, exactly as
  sent, for decode_step to judge."""
  data = bytearray(wire.encode_batch_bytes(7, LEAVES, next_stream_state="pos"))
  data[where] ^= 0x40
  got = _receive(bytes(data), 7)
  assert isinstance(got, np.ndarray) and got.tobytes() == bytes(data)


@pytest.mark.parametrize("tail", [b"\x20", b"\x20\x80", b"\x20\x05\x00", b"\x28\x05",
                                  b"\x20\x05\x1a\x01p"])
def test_a_tail_not_the_encoders_is_handed_on_whole(tail):
  """A production time cut short, followed by anything, or under another
  tag, or before the position: for the decoder to judge."""
  data = wire.encode_batch_bytes(7, LEAVES) + tail
  got = _receive(data, 7)
  assert isinstance(got, np.ndarray) and got.tobytes() == data


def test_another_step_is_handed_on_whole():
  data = wire.encode_batch_bytes(8, LEAVES)
  got = _receive(data, 7)
  assert isinstance(got, np.ndarray) and got.tobytes() == data


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_bulk_batches_are_exact_and_aligned(server, oracle, compression):
  """Over the bulk transport every leaf starts on a cache line (a page when
  large) and equals embedded mode's; zstd batches go through the decoder."""
  g = 2048
  with RemoteDataset(server.target, "forever", g, prefetch=4, transport=TransportOptions(
      kind="bulk", compression=compression)) as ds:
    it = iter(ds)
    for k in range(6):
      batch = next(it)
      assert_trees_equal(batch, oracle_batch(oracle, "forever", k, g), f"step {k}")
      if compression == "none":
        for key, leaf in batch.items():
          address = leaf.__array_interface__["data"][0]
          assert address % receive.ALIGN == 0, f"step {k} {key!r} at {address:#x}"
          assert leaf.nbytes < receive.PAGE_ALIGN_BYTES or address % PAGE == 0
    it.close()
