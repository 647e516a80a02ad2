"""What the converters hold, measured with tracemalloc in a fresh interpreter
(tests/traced.py: it counts allocations, the same figure on every run,
however loaded the machine):
the index keeps 8 bytes a record, as docs/convert.md says, and a jsonl line
is checked in a few times its bytes, whatever it holds."""

from __future__ import annotations

import pytest

from grain_elevator.tools.convert import text as text_lib
from grain_elevator.tools.convert.errors import CorruptInputError
from grain_elevator.tools.convert.text import JsonlSource, TextSource
from grain_elevator.tools.convert.tfrecord import TFRecordSource, encode_tfrecord
from traced import traced

# docs/convert.md: "indexed by the byte offset where each record starts (8
# bytes a record)"; an int64 array grows by 1/16 at a time.
DOCUMENTED_BYTES_PER_RECORD = 8

_SOURCES = {
    "jsonl": (b'{"text": "' + b"a" * 186 + b'"}\n', lambda p: JsonlSource((p,))),
    "text lines": (b"a" * 199 + b"\n", lambda p: TextSource((p,), split="lines")),
    "text paragraphs": (b"a" * 99 + b"\n\n", lambda p: TextSource((p,), split="paragraphs")),
    "tfrecord": (encode_tfrecord(b"x" * 184), lambda p: TFRecordSource((p,))),
}


def _index(kind: str, path: str, chunk: int | None = None) -> tuple[int | None, str | None]:
  """Indexes a file with the source of `kind`, reading `chunk` bytes at a
  time: its record count, or the CorruptInputError said."""
  if chunk is not None:
    text_lib._CHUNK = chunk  # pylint: disable=protected-access
  try:
    return _SOURCES[kind][1](path).index(path).count, None
  except CorruptInputError as e:
    return None, str(e)


def test_jsonl_line_of_too_many_values_is_refused_in_bounded_memory(tmp_path):
  # Valid JSON: json.loads took ~27 bytes a byte of it (1.3 GB for 48 MiB).
  items = (4 << 20) // 3
  assert items > text_lib.MAX_JSON_VALUES
  line = b'{"text": "a", "x": [' + b",".join([b"{}"] * items) + b"]}"
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"text": "a"}\n' + line + b"\n")
  (_, error), _, peak = traced(_index, "jsonl", str(path))
  assert peak <= 4 * len(line), f"{peak / len(line):.1f} bytes a byte of the line"
  assert error == (
      f"{path}: at byte 14: line 2: over {text_lib.MAX_JSON_VALUES:,} JSON values, the "
      "limit (--max-json-values)")


def test_jsonl_long_valid_line_is_checked_in_bounded_memory(tmp_path):
  """A line longer than the limit is walked, never built: a long text and
  many values under the limit pass, in memory of a few times the line."""
  items = 500_000
  line = (b'{"x": [' + b",".join([b"{}"] * items) + b'], "text": "' + b"words " * (350_000)
          + b'"}')
  assert len(line) > text_lib.MAX_JSON_VALUES > items + 4
  path = tmp_path / "a.jsonl"
  path.write_bytes(line + b"\n" + b'{"text": "b"}\n')
  (count, _), _, peak = traced(_index, "jsonl", str(path))
  assert count == 2
  assert peak <= 4 * len(line), f"{peak / len(line):.1f} bytes a byte of the line"


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_index_keeps_the_documented_bytes_per_record(tmp_path, kind):
  """The growth of indexing's peak from N to 3N records, per record: what
  does not grow with the records (buffers, one line) cancels out. Reads are
  4 KiB so the read buffer is the same for both files. A list of Python
  ints took 40 to 77 bytes a record."""
  record = _SOURCES[kind][0]
  peaks = {}
  for n in (5_000, 15_000):
    path = tmp_path / f"{n}.in"
    path.write_bytes(record * n)
    (count, _), _, peaks[n] = traced(_index, kind, str(path), 4096)
    assert count == n
  per_record = (peaks[15_000] - peaks[5_000]) / 10_000
  assert per_record <= 2 * DOCUMENTED_BYTES_PER_RECORD, f"{per_record:.1f} bytes a record"
