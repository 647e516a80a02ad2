"""The wire's limit: the same batch bytes over a plain TCP socket on loopback.

`serve` runs in its own process and sends a batch-sized buffer back to back;
`Receiver` reads each batch with `recv_into` into one preallocated buffer,
or into `buffers` page-aligned ones in turn: a loader that reads ahead
delivers each batch in a buffer of its own, which the kernel's copy then
reaches cold (a client's window of 24 steps of 4.9 MB is ~120 MB), where
one buffer stays in cache. The client is compared with both.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import sys

from grain_elevator.tools.bench import portfile


def serve(port_file: str, batch_bytes: int) -> None:
  payload = os.urandom(batch_bytes)
  with socket.create_server(("127.0.0.1", 0)) as server:
    portfile.write(port_file, server.getsockname()[1])
    while True:
      conn, _ = server.accept()
      with conn:
        try:
          while True:
            conn.sendall(payload)
        except OSError:
          pass


class Receiver:
  """Reads whole batches from a `serve` process."""

  def __init__(self, port: int, batch_bytes: int, buffers: int = 1):
    self._sock = socket.create_connection(("127.0.0.1", port))
    self._views = [memoryview(bytearray(batch_bytes))] if buffers <= 1 else [
        memoryview(mmap.mmap(-1, batch_bytes)) for _ in range(buffers)]  # page-aligned
    self._turn = 0

  def next_batch(self) -> int:
    view = self._views[self._turn]
    self._turn = (self._turn + 1) % len(self._views)
    got, n = 0, len(view)
    while got < n:
      r = self._sock.recv_into(view[got:], n - got)
      if not r:
        raise ConnectionError("tcp sender closed")
      got += r
    return n

  def close(self) -> None:
    self._sock.close()


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("port_file")
  p.add_argument("batch_bytes", type=int)
  a = p.parse_args()
  serve(a.port_file, a.batch_bytes)
  sys.exit(0)
