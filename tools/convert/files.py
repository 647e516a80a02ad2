"""The converters' input files: glob patterns, compression, exact reads.

What the line- and record-framed sources (`tfrecord.py`, `text.py`) share
(their indexes: an int64 byte offset per record), and the glob expansion
every source uses. Every length is bounded by the
caller before a read; a short or undecodable read is a `CorruptInputError`
naming the file and the byte offset.
"""

from __future__ import annotations

import array
import dataclasses
import glob
import gzip
import io
import os
import zlib
from typing import Any, Sequence

from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError

COMPRESSIONS = ("auto", "none", "gzip", "zlib")
_BIG_READ = 64 << 20  # reads above this are made in pieces (no up-front allocation)


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of records of one framed file: `count` records in bytes
  [start, end) of its (decompressed) stream."""

  path: str
  compression: str
  start: int  # byte offset of the first record (in the decompressed stream)
  end: int  # byte offset just past the last record
  count: int


def offsets() -> array.array:
  """An empty array of byte offsets, int64: 8 bytes a record (6% more while
  it grows), where a list of Python ints took ~50 (the int, its slot, and a
  copy when made into an array). Indexes keep one offset per record."""
  return array.array("q")


def check_options(compression: str, max_record_bytes: int, least: int) -> None:
  """A source's --compression and --max-record-bytes, or ConvertError."""
  if compression not in COMPRESSIONS:
    raise ConvertError(f"--compression must be one of {', '.join(COMPRESSIONS)}, "
                       f"got {compression!r}")
  if max_record_bytes < least:
    raise ConvertError(f"--max-record-bytes must be >= {least}")


def compression_of(path: str, compression: str) -> str:
  """`compression`, or for "auto" the one `path`'s extension names."""
  if compression != "auto":
    return compression
  lower = path.lower()
  if lower.endswith((".gz", ".gzip")):
    return "gzip"
  if lower.endswith((".zz", ".zlib")):
    return "zlib"
  return "none"


class _ZlibReader(io.RawIOBase):
  """A zlib stream (TFRecord's ZLIB compression) as a readable file."""

  def __init__(self, raw: Any, path: str):
    self._raw, self._path = raw, path
    self._z = zlib.decompressobj()
    self._buf = b""

  def readable(self) -> bool:
    return True

  def readinto(self, b) -> int:
    while not self._buf:
      if self._z.eof:
        return 0
      chunk = self._z.unconsumed_tail or self._raw.read(1 << 20)
      if not chunk:
        raise CorruptInputError(self._path, self._raw.tell(),
                                "the zlib stream ends early (truncated)")
      try:
        self._buf = self._z.decompress(chunk, 1 << 20)
      except zlib.error as e:
        raise CorruptInputError(self._path, self._raw.tell(), f"bad zlib data: {e}") from e
    n = min(len(b), len(self._buf))
    b[:n] = self._buf[:n]
    self._buf = self._buf[n:]
    return n

  def close(self) -> None:
    self._raw.close()
    super().close()


def open_input(path: str, compression: str):
  """(a buffered reader of the record stream, its size or None if unknown)."""
  try:
    raw = open(path, "rb", buffering=1 << 20)  # pylint: disable=consider-using-with
  except OSError as e:
    raise ConvertError(f"cannot read {path}: {e}") from e
  if compression == "none":
    return raw, os.fstat(raw.fileno()).st_size
  if compression == "gzip":
    return io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), 1 << 20), None
  if compression == "zlib":
    return io.BufferedReader(_ZlibReader(raw, path), 1 << 20), None
  raise ConvertError(f"--compression must be one of {', '.join(COMPRESSIONS)}, "
                     f"got {compression!r}")


def read_exactly(f, n: int, path: str, offset: int, what: str) -> bytes:
  """Exactly n bytes (n already bounded), or CorruptInputError."""
  try:
    if n <= _BIG_READ:
      data = f.read(n)
    else:
      parts, left = [], n
      while left:
        part = f.read(min(left, _BIG_READ))
        if not part:
          break
        parts.append(part)
        left -= len(part)
      data = b"".join(parts)
  except (OSError, EOFError, zlib.error) as e:  # gzip raises these on bad data
    if isinstance(e, CorruptInputError):
      raise
    raise CorruptInputError(path, offset, f"cannot read {what}: {e}") from e
  if len(data) != n:
    raise CorruptInputError(path, offset, f"the file ends inside {what} ({len(data)} of "
                                          f"{n} bytes): truncated")
  return data


def skip(f, n: int, path: str, offset: int, seekable: bool) -> None:
  if seekable:
    f.seek(n, io.SEEK_CUR)
    return
  while n:
    chunk = read_exactly(f, min(n, 1 << 20), path, offset, "the skipped bytes")
    n -= len(chunk)


def expand(patterns: Sequence[str]) -> list[str]:
  """The sorted union of the files the glob patterns match; each must match."""
  files: set[str] = set()
  for pattern in patterns:
    matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
               if os.path.isfile(p)]
    if not matched:
      raise ConvertError(f"{pattern!r} matches no files")
    files.update(os.path.abspath(p) for p in matched)
  return sorted(files)
