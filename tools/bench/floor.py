"""The floor for serving these shards: shard reads plus a plain socket.

Each sender process reads G random records of the benchmark's shards with
the server's own reader (`BatchedArrayRecordSource`, i.e.
server/data/shards/reader.py), sends their bytes back to back with one `sendmsg`,
and repeats: no Grain pipeline, no shuffle map, no decode, no framing, no
gRPC. The receiver reads each batch into a fresh buffer, as the service's
client does. What the service delivers on top of this is its whole cost
beyond reading and moving bytes; what this reaches is the most a server
reading the shards this way could on the same cores.
"""

from __future__ import annotations

import argparse
import queue
import random
import socket
import sys
import threading
from typing import Sequence

import numpy as np

from grain_elevator.proto import framing
from grain_elevator.server.data.record_source import BatchedArrayRecordSource
from grain_elevator.server.data.records import mark_absl_flags_parsed
from grain_elevator.tools.bench import portfile


def _send_batches(conn: socket.socket, files: Sequence[str], global_batch_size: int,
                  seed: int) -> None:
  source = BatchedArrayRecordSource(list(files))  # the server's own shard reads
  rng = random.Random(seed)
  try:
    while True:
      positions = [rng.randrange(len(source)) for _ in range(global_batch_size)]
      framing.send_parts(conn, source._getitems(positions))  # pylint: disable=protected-access
  except OSError:
    pass  # the receiver is done
  finally:
    conn.close()


def serve(port_file: str, files: Sequence[str], global_batch_size: int) -> None:
  mark_absl_flags_parsed()
  with socket.create_server(("127.0.0.1", 0)) as server:
    portfile.write(port_file, server.getsockname()[1])
    for seed in range(1 << 30):
      conn, _ = server.accept()
      threading.Thread(target=_send_batches, args=(conn, files, global_batch_size, seed),
                       daemon=True).start()


class Receiver:
  """One connection per sender process, each read by a thread into fresh
  buffers; batches are handed over through a bounded queue."""

  def __init__(self, ports: Sequence[int], batch_bytes: int, in_flight: int = 8):
    self._batch_bytes = batch_bytes
    self._queue: queue.Queue[np.ndarray | BaseException] = queue.Queue(in_flight)
    self._socks = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    self._stop = threading.Event()
    for sock in self._socks:
      threading.Thread(target=self._receive, args=(sock,), daemon=True).start()

  def _receive(self, sock: socket.socket) -> None:
    try:
      while not self._stop.is_set():
        batch = np.empty(self._batch_bytes, dtype=np.uint8)
        framing.recv_into(sock, memoryview(batch))
        self._queue.put(batch)
    except OSError as e:
      if not self._stop.is_set():
        self._queue.put(e)

  def next_batch(self) -> int:
    got = self._queue.get()
    if isinstance(got, BaseException):
      raise ConnectionError(f"floor sender failed: {got}")
    return got.nbytes

  def close(self) -> None:
    self._stop.set()
    for sock in self._socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      sock.close()


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("port_file")
  p.add_argument("global_batch_size", type=int)
  p.add_argument("files", nargs="+")
  a = p.parse_args()
  serve(a.port_file, a.files, a.global_batch_size)
  sys.exit(0)
