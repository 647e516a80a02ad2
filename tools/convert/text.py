"""`elevator convert jsonl` and `elevator convert text`: text for language
models into ArrayRecord, byte for byte.

* ``jsonl``: one record per non-blank line of JSON Lines files: the line's
  bytes as they are in the file. Every such line must be a JSON object in
  UTF-8 and hold a string under `field` (what the text pipeline tokenizes),
  so the printed table serves what was written, and at most
  `max_json_values` JSON values (json_check.py: checked without building
  them, so a long line costs what its bytes do, not ~24 bytes a byte).
* ``text``: plain UTF-8 text, ``split`` into records: ``files`` (a file's
  bytes, unchanged), ``lines`` (each non-blank line) or ``paragraphs`` (each
  run of non-blank lines; blank lines separate them).

Lines end at ``\\n``; a ``\\r`` before it (or at the end of the file) is part
of the line ending, so a CRLF file's lines are the same records as an LF
file's (a paragraph or a file keeps the line endings inside it). A line
is *blank* when it holds nothing but ASCII whitespace; blank lines make no
record (their number is in the summary). A last line without a newline is a
line. Inside a paragraph, a ``files`` record and a line, every byte is kept.

Input files go in sorted name order, records in file order. Indexing
streams each file once (memory bounded by the longest record, at most
`max_record_bytes`), checks it, and keeps the byte offset where each record
starts, so a worker reads any range of a file's records without the rest.
What is wrong with an input fails the conversion as a `CorruptInputError`
naming the file, the byte offset and the line number. Compressed files
(``.gz``, ``.zz``) are read as tfrecord.py reads them; their offsets are into
the decompressed stream.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
from typing import Any, Iterator, Sequence

from grain_elevator.tools.convert import files
from grain_elevator.tools.convert import json_check
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError
from grain_elevator.tools.convert.files import Segment

# The largest record (a line, a paragraph, a file) taken; longer is an error.
MAX_RECORD_BYTES = 64 << 20
# The most JSON values a jsonl line may hold (objects, arrays, keys, strings,
# numbers, literals): Python takes up to ~70 bytes a value to parse one, here
# and in the serving pipeline (json_check.py says how lines are checked).
MAX_JSON_VALUES = 1 << 20
SPLITS = ("files", "lines", "paragraphs")
DEFAULT_FIELD = "text"
PIPELINE = "grain_elevator.pipelines.text:tokenize"
ITER_PIPELINE = "grain_elevator.pipelines.text:chunk_and_pack"
TOKENIZER = "tokenizer.json"
LENGTH = 2048
NUM_PACKING_BINS = 64
_CHUNK = 1 << 20  # bytes read at a time
_BLANK_LINES = "blank lines"
# What scanning a file finds: (record start offsets, end of the last record,
# (what, how many) left out, (path, why) skipped).
_Scan = tuple[array.array, int, tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]


def _read_some(f: Any, n: int, path: str, offset: int) -> bytes:
  """Up to n bytes; a damaged compressed stream raises CorruptInputError."""
  try:
    return f.read(n)
  except CorruptInputError:
    raise
  except (OSError, EOFError, ValueError) as e:  # gzip and zlib errors
    raise CorruptInputError(path, offset, f"cannot read: {e}") from e


def _lines(f: Any, path: str, start: int, end: int | None, limit: int
           ) -> Iterator[tuple[int, bytes, int]]:
  """(offset, line, offset of the next line) of each line of the stream from
  byte `start` (where `f` stands) to `end` (None: its end). A line comes
  without its ``\\n`` but with a ``\\r`` before it; none may hold more than
  `limit` bytes besides that ``\\r``, which is checked before a line is held
  whole. Errors name the line's number where the range starts the file."""
  pos = start  # offset of the next byte read
  number = 1  # of the next line
  line_start = start
  parts: list[bytes] = []  # the line so far, when it spans reads
  pending = 0
  while True:
    n = _CHUNK if end is None else min(_CHUNK, end - pos)
    chunk = _read_some(f, n, path, pos) if n > 0 else b""
    if not chunk:
      if end is not None and pos < end:
        raise CorruptInputError(path, pos, f"the file ends {end - pos:,} bytes early: "
                                           "did it change while converting?")
      if parts:
        yield line_start, b"".join(parts), pos
      return
    pieces = chunk.split(b"\n")
    at = pos
    pos += len(chunk)
    for piece in pieces[:-1]:
      line = b"".join(parts + [piece]) if parts else piece
      parts, pending = [], 0
      if len(line) - line.endswith(b"\r") > limit:
        raise CorruptInputError(path, line_start, f"{_line_no(start, number)}a line of "
                                                  f"{len(line):,} bytes, over the limit of "
                                                  f"{limit:,} (--max-record-bytes)")
      at += len(piece) + 1
      yield line_start, line, at
      line_start = at
      number += 1
    last = pieces[-1]
    if last:
      parts.append(last)
      pending += len(last)
      if pending > limit + 1:
        raise CorruptInputError(path, line_start, f"{_line_no(start, number)}a line of "
                                                  f"over {limit:,} bytes, the limit "
                                                  "(--max-record-bytes)")


def _line_no(start: int, number: int) -> str:
  """"line N: " where lines are counted from the file's start."""
  return f"line {number}: " if start == 0 else ""


def _blank(content: bytes) -> bool:
  """Whether a line holds nothing but ASCII whitespace (no copy made)."""
  return not content or content.isspace()


def _content(line: bytes) -> bytes:
  """The line without its line ending's ``\\r``."""
  return line[:-1] if line.endswith(b"\r") else line


def _utf8(line: bytes, path: str, offset: int, number: int) -> str:
  try:
    return line.decode("utf-8")
  except UnicodeDecodeError as e:
    raise CorruptInputError(path, offset + e.start, f"line {number}: not UTF-8 (byte "
                                                    f"0x{line[e.start]:02x}: {e.reason})"
                            ) from None


@dataclasses.dataclass(frozen=True)
class _LineSource:
  """What both formats share: files of lines, indexed by record offsets."""

  patterns: tuple[str, ...]
  compression: str = "auto"
  max_record_bytes: int = MAX_RECORD_BYTES

  def __post_init__(self):
    files.check_options(self.compression, self.max_record_bytes, 1)

  def units(self) -> list[str]:
    return files.expand(self.patterns)

  def index(self, unit: str) -> shards.Indexed:
    f, size = files.open_input(unit, files.compression_of(unit, self.compression))
    with f:
      starts, end, left_out, skipped = self._scan(unit, f, size)
    count = len(starts)
    starts.append(end)
    return shards.Indexed(count, os.path.getsize(unit), starts, skipped, left_out)

  def _scan(self, path: str, f: Any, size: int | None) -> _Scan:
    """Checks every line of one file and finds where its records start."""
    raise NotImplementedError

  def segment(self, unit: str, indexed: shards.Indexed, start: int, stop: int) -> Segment:
    offsets = indexed.data
    return Segment(unit, files.compression_of(unit, self.compression), int(offsets[start]),
                   int(offsets[stop]), stop - start)

  def _stream(self, segment: Segment) -> Iterator[tuple[int, bytes, int]]:
    """The lines of a segment's byte range."""
    f, _ = files.open_input(segment.path, segment.compression)
    with f:
      if segment.compression == "none":
        f.seek(segment.start)
      else:
        files.skip(f, segment.start, segment.path, 0, seekable=False)
      yield from _lines(f, segment.path, segment.start, segment.end, self.max_record_bytes)

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    """Each non-blank line (the lines of a segment's range)."""
    for _, line, _ in self._stream(segment):
      content = _content(line)
      if not _blank(content):
        yield content

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {}

  def check(self, indexes: Sequence[tuple[str, shards.Indexed]]) -> None:
    pass

  def side_files(self) -> dict[str, bytes]:
    return {}

  def _serving(self, comments: tuple[str, ...], field: str | None) -> snippet_lib.Serving:
    options: dict[str, Any] = {"tokenizer": TOKENIZER}
    notes = {"tokenizer": "a Hugging Face tokenizers file; `elevator make-tokenizer "
                          f"{TOKENIZER}` trains one"}
    if field is not None:
      options["field"] = field
      notes["field"] = "the JSON key holding the text"
    how = ("tokenized, cut into chunks and packed into rows of `length` tokens; the "
           "tokenizer's path is relative to this file's folder")
    return snippet_lib.Serving(
        pipeline=PIPELINE, options=options, comments=(*comments, how),
        option_comments=notes, iter_pipeline=ITER_PIPELINE,
        iter_options={"length": LENGTH, "num_packing_bins": NUM_PACKING_BINS})


@dataclasses.dataclass(frozen=True)
class JsonlSource(_LineSource):
  """JSON Lines files matched by glob patterns: a record per non-blank line,
  each a JSON object holding a string under `field`."""

  field: str = DEFAULT_FIELD
  max_json_values: int = MAX_JSON_VALUES
  kind = "jsonl"

  def __post_init__(self):
    super().__post_init__()
    if not self.field:
      raise ConvertError("--field must name a JSON key")
    if self.max_json_values < 1:
      raise ConvertError("--max-json-values must be >= 1")

  def _scan(self, path: str, f: Any, size: int | None) -> _Scan:
    starts = files.offsets()
    end = blank = 0
    lines = _lines(f, path, 0, size, self.max_record_bytes)
    for number, (offset, line, _) in enumerate(lines, 1):
      content = _content(line)
      if _blank(content):
        blank += 1
        continue
      self._check(content, path, offset, number)
      starts.append(offset)
      end = offset + len(content)
    return starts, end, ((_BLANK_LINES, blank),), ()

  def _check(self, line: bytes, path: str, offset: int, number: int) -> None:
    """Raises unless the line is a JSON object with a string under `field`
    and at most `max_json_values` values (checked without building them)."""
    text = _utf8(line, path, offset, number)
    try:
      kind, field_kind = json_check.check(text, self.field, self.max_json_values)
    except json.JSONDecodeError as e:
      raise CorruptInputError(path, offset, f"line {number}: not JSON: {e.msg} (column "
                                            f"{e.colno})") from None
    except json_check.TooManyValues:
      raise CorruptInputError(path, offset, f"line {number}: over {self.max_json_values:,} "
                                            "JSON values, the limit (--max-json-values)"
                              ) from None
    except (RecursionError, json_check.TooDeep):
      raise CorruptInputError(path, offset, f"line {number}: JSON nested too deeply "
                                            "to read") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
      raise CorruptInputError(path, offset, f"line {number}: unreadable JSON: {e}") from None
    if kind != "an object":
      raise CorruptInputError(path, offset, f"line {number}: {kind}, not a JSON object")
    if field_kind is None:
      raise CorruptInputError(path, offset, f"line {number}: no {json.dumps(self.field)} "
                                            "key (--field)")
    if field_kind != "a string":
      raise CorruptInputError(path, offset, f"line {number}: {json.dumps(self.field)} "
                                            f"holds {field_kind}, not a string (--field)")

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    what = (f"records: JSON lines as they are in the files, the text under "
            f"{json.dumps(self.field)}")
    return self._serving((what,), self.field)


@dataclasses.dataclass(frozen=True)
class TextSource(_LineSource):
  """UTF-8 text files matched by glob patterns, `split` into records."""

  split: str = "files"
  kind = "text"

  def __post_init__(self):
    super().__post_init__()
    if self.split not in SPLITS:
      raise ConvertError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")

  def _scan(self, path: str, f: Any, size: int | None) -> _Scan:
    limit = self.max_record_bytes
    if self.split == "files" and size is not None and size > limit:
      raise CorruptInputError(path, 0, f"a file of {size:,} bytes, over the limit of "
                                       f"{limit:,} (--max-record-bytes)")
    starts = files.offsets()
    end = blank = 0
    first = -1  # where the current paragraph starts (-1: between paragraphs)
    stop = 0  # where the stream ends, as read
    for number, (offset, line, stop) in enumerate(_lines(f, path, 0, size, limit), 1):
      content = _content(line)
      _utf8(content, path, offset, number)
      if self.split == "files" and stop > limit:  # a compressed file: size unknown before
        raise CorruptInputError(path, 0, f"a file of over {limit:,} bytes, the limit "
                                         "(--max-record-bytes)")
      if _blank(content):
        blank += 1
        first = -1
        continue
      if self.split == "lines":
        starts.append(offset)
      elif self.split == "paragraphs":
        if first < 0:
          first = offset
          starts.append(offset)
        if offset + len(content) - first > limit:
          raise CorruptInputError(path, first, f"line {number}: a paragraph of over "
                                               f"{limit:,} bytes, the limit "
                                               "(--max-record-bytes)")
      elif not starts:
        starts.append(0)
      end = offset + len(content)
    if self.split == "files":
      if stop > limit:
        raise CorruptInputError(path, 0, f"a file of {stop:,} bytes, over the limit of "
                                         f"{limit:,} (--max-record-bytes)")
      skipped = () if starts else ((path, "empty" if stop == 0 else "only blank lines"),)
      return starts, stop, (), skipped
    # Blank lines are what separates paragraphs: only counted for `lines`.
    return starts, end, ((_BLANK_LINES, blank if self.split == "lines" else 0),), ()

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    if self.split == "lines":
      yield from super().read(segment, stats)
    elif self.split == "paragraphs":
      yield from self._paragraphs(segment)
    else:
      yield self._file(segment)

  def _paragraphs(self, segment: Segment) -> Iterator[bytes]:
    """Each run of non-blank lines, exactly as in the file."""
    lines: list[bytes] = []
    size = 0
    for offset, line, _ in self._stream(segment):
      if _blank(_content(line)):
        if lines:
          yield _content(b"\n".join(lines))
          lines, size = [], 0
        continue
      lines.append(line)
      size += len(line) + 1
      if size > self.max_record_bytes + 2:
        raise CorruptInputError(segment.path, offset, "a paragraph over the limit: did "
                                                      "the file change while converting?")
    if lines:
      yield _content(b"\n".join(lines))

  def _file(self, segment: Segment) -> bytes:
    """The whole file (its size checked by indexing)."""
    f, _ = files.open_input(segment.path, segment.compression)
    with f:
      data = files.read_exactly(f, segment.end, segment.path, 0, "the file")
      if _read_some(f, 1, segment.path, segment.end):
        raise CorruptInputError(segment.path, segment.end, "the file grew: did it change "
                                                           "while converting?")
    return data

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    what = {"files": "a file's bytes", "lines": "a line",
            "paragraphs": "a paragraph (lines between blank lines)"}[self.split]
    return self._serving((f"records: UTF-8 text, each {what} as in the input",), None)
