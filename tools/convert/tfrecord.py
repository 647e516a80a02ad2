"""`elevator convert tfrecord`: TFRecord files into ArrayRecord, without TensorFlow.

A TFRecord file is a sequence of records, each framed as::

  uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

(little-endian; ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 mod 2**32``).
Both CRCs are checked, and every length is checked before anything is
allocated for it: against `max_record_bytes` (default MAX_RECORD_BYTES) and
against what is left of the file. A damaged file fails the conversion with a
`CorruptInputError` naming the file and the byte offset of the bad record.

Records keep their order: input files in sorted name order, records in file
order; the shards' records, read in shard-name order, are the TFRecord
records byte for byte. gzip- and zlib-compressed files are read too
(``compression="auto"`` goes by the extension: .gz, .gzip, .zz, .zlib); their
offsets are offsets into the decompressed stream.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from typing import Any, Iterator, Sequence

from grain_elevator.tools.convert import files
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError
from grain_elevator.tools.convert.files import Segment

MAX_RECORD_BYTES = 2 << 30
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8
_SAMPLE_RECORDS = 32
_SAMPLE_BYTES = 1 << 20


def _crc32c_function():
  try:
    import google_crc32c  # pylint: disable=g-import-not-at-top
    return google_crc32c.value
  except ImportError:
    pass
  try:
    import crc32c  # pylint: disable=g-import-not-at-top
    return crc32c.crc32c
  except ImportError:
    raise ConvertError("reading TFRecord needs a CRC32C implementation: "
                       "pip install 'grain-elevator[convert]' (google-crc32c)") from None


def masked_crc32c(data: bytes | memoryview) -> int:
  """TFRecord's masked CRC32C of `data`."""
  crc = _crc32c_function()(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def encode_tfrecord(data: bytes) -> bytes:
  """One record framed as TFRecord (for tests and tools)."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


def _records(f, path: str, *, start: int, end: int | None, count: int | None,
             max_record_bytes: int, read_data: bool
             ) -> Iterator[tuple[int, int, bytes | None]]:
  """(offset, length, data) of the records from byte `start` (where `f` stands) up
  to `end` (None: to the end of the stream), each framing checked; data is
  None (skipped, its CRC unchecked) unless `read_data`."""
  crc = _crc32c_function()
  pos, n = start, 0
  seekable = end is not None and not read_data
  while count is None or n < count:
    if end is not None and pos == end:
      break
    try:
      header = f.read(_HEADER.size)
    except (OSError, EOFError, zlib.error) as e:
      if isinstance(e, CorruptInputError):
        raise
      raise CorruptInputError(path, pos, f"cannot read a record header: {e}") from e
    if not header and end is None:
      break
    if len(header) != _HEADER.size:
      raise CorruptInputError(path, pos, f"the file ends inside a record header "
                                         f"({len(header)} of 12 bytes): truncated")
    length, length_crc = _HEADER.unpack(header)
    expect = crc(header[:8])
    if length_crc != ((((expect >> 15) | (expect << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF:
      raise CorruptInputError(path, pos, "the record length fails its CRC: corrupt "
                                         "(or not a TFRecord file)")
    if length > max_record_bytes:
      raise CorruptInputError(path, pos, f"a record of {length:,} bytes, over the limit of "
                                         f"{max_record_bytes:,} (--max-record-bytes)")
    if end is not None and length > end - pos - 16:
      raise CorruptInputError(path, pos, f"a record of {length:,} bytes runs past the end "
                                         f"of the file ({end - pos - 16:,} bytes left): "
                                         "truncated")
    if read_data:
      data = files.read_exactly(f, length, path, pos, "a record")
      (data_crc,) = _FOOTER.unpack(files.read_exactly(f, 4, path, pos, "a record's CRC"))
      expect = crc(data)
      if data_crc != ((((expect >> 15) | (expect << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF:
        raise CorruptInputError(path, pos, f"the record's data ({length:,} bytes) fails "
                                           "its CRC: corrupt")
      yield pos, length, data
    else:
      files.skip(f, length + 4, path, pos, seekable)
      yield pos, length, None
    pos += length + 16
    n += 1


@dataclasses.dataclass(frozen=True)
class TFRecordSource:
  """TFRecord files matched by glob patterns (their sorted union)."""

  patterns: tuple[str, ...]
  compression: str = "auto"
  max_record_bytes: int = MAX_RECORD_BYTES
  kind = "tfrecord"

  def __post_init__(self):
    files.check_options(self.compression, self.max_record_bytes, 0)

  def units(self) -> list[str]:
    return files.expand(self.patterns)

  def index(self, unit: str) -> shards.Indexed:
    compression = files.compression_of(unit, self.compression)
    f, size = files.open_input(unit, compression)
    offsets, end = files.offsets(), 0
    with f:
      # Compressed files are read (and checked) whole: the stream cannot seek.
      for pos, length, _ in _records(f, unit, start=0, end=size, count=None,
                                     max_record_bytes=self.max_record_bytes,
                                     read_data=size is None):
        offsets.append(pos)
        end = pos + length + 16
    count = len(offsets)
    offsets.append(end)
    return shards.Indexed(count, os.path.getsize(unit), offsets)

  def segment(self, unit: str, indexed: shards.Indexed, start: int, stop: int) -> Segment:
    offsets = indexed.data
    return Segment(unit, files.compression_of(unit, self.compression), int(offsets[start]),
                   int(offsets[stop]), stop - start)

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    f, _ = files.open_input(segment.path, segment.compression)
    with f:
      if segment.compression == "none":
        f.seek(segment.start)
      else:
        files.skip(f, segment.start, segment.path, 0, seekable=False)
      sample = stats.setdefault("sample", [])
      for _, _, data in _records(f, segment.path, start=segment.start, end=segment.end,
                              count=segment.count, max_record_bytes=self.max_record_bytes,
                              read_data=True):
        if len(sample) < _SAMPLE_RECORDS and sum(map(len, sample)) + len(data) <= _SAMPLE_BYTES:
          sample.append(data)
        yield data

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"sample": stats[0].get("sample", []) if stats else []}

  def check(self, indexes: Sequence[tuple[str, shards.Indexed]]) -> None:
    pass

  def side_files(self) -> dict[str, bytes]:
    return {}

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    from grain_elevator.tools.convert import features  # pylint: disable=g-import-not-at-top
    return features.serving_from_sample(stats.get("sample", []))
