"""The wire's limit: the same batch bytes over a plain TCP socket on loopback.

`serve` runs in its own process and sends a batch-sized buffer back to back;
`receive` reads into one preallocated buffer with `recv_into`.
"""

from __future__ import annotations

import argparse
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

  def __init__(self, port: int, batch_bytes: int):
    self._sock = socket.create_connection(("127.0.0.1", port))
    self._buf = bytearray(batch_bytes)
    self._view = memoryview(self._buf)

  def next_batch(self) -> int:
    got, n = 0, len(self._buf)
    while got < n:
      r = self._sock.recv_into(self._view[got:], n - got)
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
