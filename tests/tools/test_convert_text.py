"""`elevator convert jsonl` and `text`: byte-exact records, determinism,
blank lines, bad input named by file, line and offset, the printed table."""

from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import tomllib

import numpy as np
import pytest

from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import text as text_lib
from grain_elevator.tools.convert.errors import CorruptInputError
from grain_elevator.tools.convert.text import JsonlSource, TextSource
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import no_leftovers, read_shards, shard_bytes


def elevator(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([*ELEVATOR, "convert", *args, "--quiet"], capture_output=True,
                        text=True, timeout=120, check=False)


# -- the oracle: what each split should give, by slicing the input -------------------

def _lines_with_offsets(data: bytes) -> list[tuple[int, int, bool]]:
  """(start, end without the line ending, blank) of each line of `data`."""
  out, pos = [], 0
  for piece in data.split(b"\n"):
    end = pos + len(piece) - piece.endswith(b"\r")
    out.append((pos, end, not data[pos:end].strip()))
    pos += len(piece) + 1
  if data.endswith(b"\n") or not data:
    out.pop()  # nothing after the last newline: no line
  return out


def want_lines(files: list[bytes]) -> list[bytes]:
  return [d[s:e] for d in files for s, e, blank in _lines_with_offsets(d) if not blank]


def want_paragraphs(files: list[bytes]) -> list[bytes]:
  out = []
  for d in files:
    first = last = None
    for s, e, blank in _lines_with_offsets(d) + [(0, 0, True)]:
      if blank:
        if first is not None:
          out.append(d[first:last])
        first = None
      else:
        first = s if first is None else first
        last = e
  return out


def want_files(files: list[bytes]) -> list[bytes]:
  return [d for d in files if d.strip()]


# -- inputs ----------------------------------------------------------------------------

def _texts(rng: np.random.Generator, n: int) -> list[str]:
  words = ["grain", "élévateur", "数据", "🙂", "tab\there", 'quote"s', "back\\slash", "x"]
  return [" ".join(rng.choice(words, size=int(rng.integers(1, 8)))) for _ in range(n)]


@pytest.fixture
def jsonl_files(tmp_path) -> list[pathlib.Path]:
  """Three JSONL files: LF with blank and whitespace lines, CRLF without a
  final newline, an empty one; odd spacing and escapes kept as written."""
  rng = np.random.default_rng(0)
  folder = tmp_path / "in"
  folder.mkdir()
  texts = _texts(rng, 60)
  a = [json.dumps({"id": i, "text": t}, ensure_ascii=bool(i % 2)) for i, t in enumerate(texts[:40])]
  a[3] = '  { "text" : "spaced\\nout" , "n": [1, {"a": null}] }  '  # spaces kept
  a.insert(5, "")
  a.insert(9, " \t ")
  a.insert(10, "\r")
  b = [json.dumps({"text": t, "meta": {"k": 1.5}}) for t in texts[40:]]
  b.insert(0, "")
  (folder / "a.jsonl").write_bytes(("\n".join(a) + "\n\n").encode())
  (folder / "b.jsonl").write_bytes("\r\n".join(b).encode())  # no final newline
  (folder / "c.jsonl").write_bytes(b"")
  return [folder / "a.jsonl", folder / "b.jsonl", folder / "c.jsonl"]


@pytest.fixture
def text_files(tmp_path) -> list[pathlib.Path]:
  rng = np.random.default_rng(1)
  folder = tmp_path / "txt"
  folder.mkdir()
  texts = _texts(rng, 80)
  one = "\n".join(texts[:10]) + "\n\n\n" + "\n".join(texts[10:20]) + "\n  \n" + texts[20] + "\n"
  two = ("\r\n" + "\r\n".join(texts[21:30]) + "\r\n\r\n" + texts[30] + " \r trailing \r\n"
         + texts[31])  # CRLF, a lone \r inside a line, no final newline
  three = "\n\n" + "\n\n".join(texts[32:80]) + "\n\n"
  paths = []
  for i, data in enumerate([one, two, three]):
    paths.append(folder / f"{i}.txt")
    paths[-1].write_bytes(data.encode())
  (folder / "3.txt").write_bytes(b" \n\t\n")  # only blank lines
  return paths + [folder / "3.txt"]


def _data(paths: list[pathlib.Path]) -> list[bytes]:
  return [p.read_bytes() for p in sorted(paths)]


# -- exact, deterministic output ------------------------------------------------------

def test_the_oracle():
  data = b"a\r\n\r\n b \nc\n\n\n\nd\re\r"
  assert want_lines([data]) == [b"a", b" b ", b"c", b"d\re"]
  assert want_paragraphs([data]) == [b"a", b" b \nc", b"d\re"]
  assert want_lines([b"", b"\n", b"x"]) == [b"x"]


@pytest.mark.parametrize("num_shards", [1, 4, 13])
def test_jsonl_round_trips_exactly_whatever_the_workers(tmp_path, jsonl_files, num_shards):
  want = want_lines(_data(jsonl_files))
  assert len(want) == 60 and b'  { "text" : "spaced\\nout" , "n": [1, {"a": null}] }  ' in want
  outs = []
  for workers in (1, 2):
    out = tmp_path / f"w{workers}" / "corpus"
    summary = shards.convert(JsonlSource((str(tmp_path / "in" / "*.jsonl"),)), str(out),
                             num_shards=num_shards, workers=workers, progress=False)
    assert (summary.records, summary.shards) == (60, num_shards)
    assert summary.left_out == (("blank lines", 5),)
    assert read_shards(out) == want
    outs.append(shard_bytes(out))
  assert outs[0] == outs[1]


@pytest.mark.parametrize("split,oracle,count", [
    ("files", want_files, 3), ("lines", want_lines, 80), ("paragraphs", want_paragraphs, 53)])
def test_text_round_trips_exactly_whatever_the_workers_and_shards(tmp_path, text_files, split,
                                                                 oracle, count):
  want = oracle(_data(text_files))
  assert len(want) == count
  outs = {}
  for workers, num_shards in ((1, 3), (2, 3), (2, 2)):
    out = tmp_path / f"w{workers}s{num_shards}" / "books"
    summary = shards.convert(TextSource((str(tmp_path / "txt" / "*.txt"),), split=split),
                             str(out), num_shards=num_shards, workers=workers, progress=False)
    assert read_shards(out) == want  # the same order whatever the shard count
    outs[workers, num_shards] = shard_bytes(out)
    if split == "files":
      assert summary.skipped == ((str(text_files[3]), "only blank lines"),)
    if split == "lines":
      assert summary.left_out == (("blank lines", 57),)
  assert outs[1, 3] == outs[2, 3]


def test_lines_that_span_reads(tmp_path, text_files, jsonl_files, monkeypatch):
  """Reads of a few bytes: lines, CRLFs and paragraphs cut across reads."""
  monkeypatch.setattr(text_lib, "_CHUNK", 3)
  big = tmp_path / "big.jsonl"
  big.write_bytes(b'{"text": "' + b"y" * 5000 + b'"}\r\n{"text": ""}')
  cases = [(JsonlSource((str(tmp_path / "in" / "*"), str(big))),
            want_lines(_data(jsonl_files + [big])))]
  for split, oracle in (("files", want_files), ("lines", want_lines),
                        ("paragraphs", want_paragraphs)):
    cases.append((TextSource((str(tmp_path / "txt" / "*"),), split=split),
                  oracle(_data(text_files))))
  for i, (source, want) in enumerate(cases):
    out = tmp_path / f"out{i}"
    shards.convert(source, str(out), num_shards=2, workers=1, progress=False)
    assert read_shards(out) == want


@pytest.mark.parametrize("split", ["lines", "paragraphs"])
def test_any_range_of_records_reads_alone(text_files, split):
  """What a worker does: read records [start, stop) of a file, nothing else."""
  source = TextSource((str(text_files[1]),), split=split)
  unit = source.units()[0]
  ix = source.index(unit)
  want = (want_lines if split == "lines" else want_paragraphs)([text_files[1].read_bytes()])
  assert ix.count == len(want)
  for start in range(ix.count + 1):
    for stop in range(start, ix.count + 1):
      assert list(source.read(source.segment(unit, ix, start, stop), {})) == want[start:stop]


def test_gzip_inputs(tmp_path, jsonl_files):
  folder = tmp_path / "gz"
  folder.mkdir()
  for p in jsonl_files:
    with gzip.open(folder / (p.name + ".gz"), "wb") as f:
      f.write(p.read_bytes())
  out = tmp_path / "out"
  shards.convert(JsonlSource((str(folder / "*.jsonl.gz"),)), str(out), num_shards=3,
                 workers=1, progress=False)
  assert read_shards(out) == want_lines(_data(jsonl_files))
  (folder / "z.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 2}\n'))
  with pytest.raises(CorruptInputError) as e:  # offsets into the decompressed stream
    shards.convert(JsonlSource((str(folder / "*.jsonl.gz"),)), str(tmp_path / "o2"),
                   workers=1, progress=False)
  assert (e.value.path, e.value.offset) == (str(folder / "z.jsonl.gz"), 14)
  no_leftovers(tmp_path / "o2")
  (folder / "z.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30])
  with pytest.raises(CorruptInputError, match="cannot read") as e:  # truncated
    shards.convert(JsonlSource((str(folder / "z.jsonl.gz"),)), str(tmp_path / "o2"),
                   workers=1, progress=False)
  no_leftovers(tmp_path / "o2")


@pytest.mark.parametrize("line,what", [
    (b'{"text": "a", "n": ' + b"1" * 5000 + b"}", "unreadable JSON: Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    (b'\xef\xbb\xbf{"text": "a"}', "not JSON: Unexpected UTF-8 BOM"),
])
def test_jsonl_lines_python_cannot_read(tmp_path, line, what):
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"text": "a"}\n' + line + b"\n")
  with pytest.raises(CorruptInputError, match=f"line 2: {what}") as e:
    JsonlSource((str(path),)).index(str(path))
  assert e.value.offset == 14


# -- the CLI: the printed table, bad inputs ---------------------------------------------

def test_cli_prints_the_text_table(tmp_path, jsonl_files, text_files):
  out = tmp_path / "corpus"
  run = elevator("jsonl", str(tmp_path / "in" / "*.jsonl"), str(out), "--shards", "2")
  assert run.returncode == 0, run.stderr
  assert "wrote 60 records in 2 shards" in run.stderr
  assert "left out 5 blank lines" in run.stderr
  for text in (run.stdout, (out / "elevator.toml").read_text()):
    ds = tomllib.loads(text)["datasets"]["corpus"]
    assert ds["pipeline"] == "grain_elevator.pipelines.text:tokenize"
    assert ds["iter_pipeline"] == "grain_elevator.pipelines.text:chunk_and_pack"
    assert ds["options"] == {"tokenizer": "tokenizer.json", "field": "text"}
    assert ds["iter_options"] == {"length": 2048, "num_packing_bins": 64}
  assert tomllib.loads(run.stdout)["datasets"]["corpus"]["paths"] == [
      str(out / "train-*-of-00002.array_record")]
  assert "`elevator make-tokenizer tokenizer.json` trains one" in run.stdout

  out = tmp_path / "books"
  run = elevator("text", str(tmp_path / "txt" / "*.txt"), str(out), "--split", "paragraphs",
                 "--name", "lm")
  assert run.returncode == 0, run.stderr
  ds = tomllib.loads(run.stdout)["datasets"]["lm"]
  assert ds["options"] == {"tokenizer": "tokenizer.json"}  # no field
  assert ds["iter_pipeline"] == "grain_elevator.pipelines.text:chunk_and_pack"
  from grain_elevator.server.data.config import load_config  # pylint: disable=g-import-not-at-top
  cfg = load_config(out / "elevator.toml").datasets["lm"]
  assert cfg.iter_options["length"] == 2048 and len(cfg.files) == 1
  assert read_shards(out) == want_paragraphs(_data(text_files))


def _bad(line: bytes) -> tuple[bytes, int]:
  """A JSONL file whose line 7 (a blank line before it) is `line`; the
  offset of that line."""
  lines = [b'{"text": "fine %d"}' % i for i in range(10)]
  lines[6] = line
  lines[2] = b""
  return b"\n".join(lines) + b"\n", sum(len(x) + 1 for x in lines[:6])


@pytest.mark.parametrize("line,what,column,workers", [
    (b'{"text": "cut', "not JSON: Unterminated string", 0, 2),  # found in a worker
    (b'{"text": "a"} x', "not JSON: Extra data", 0, 1),
    (b'["text"]', "an array, not a JSON object", 0, 1),
    (b'"text"', "a string, not a JSON object", 0, 1),
    (b'{"body": "a"}', 'no "text" key (--field)', 0, 2),
    (b'{"text": 3}', '"text" holds a number, not a string', 0, 1),
    (b'{"text": null}', '"text" holds null, not a string', 0, 1),
    (b'{"text": "caf\xc3"}', "not UTF-8", 13, 2),  # the offset of the bad byte
    (b'{"text": NaN x}', "not JSON", 0, 1),
])
def test_jsonl_bad_lines_fail_naming_file_line_and_offset(tmp_path, line, what, column,
                                                          workers):
  folder = tmp_path / "in"
  folder.mkdir()
  (folder / "a.jsonl").write_bytes(b'{"text": "ok"}\n')
  bad = folder / "b.jsonl"
  data, offset = _bad(line)
  bad.write_bytes(data)
  offset += column
  out = tmp_path / "out"
  run = elevator("jsonl", str(folder / "*.jsonl"), str(out), "--workers", str(workers))
  assert run.returncode == 2, run.stderr
  assert run.stderr.startswith(f"elevator: error: {bad}: at byte {offset}: line 7: "), run.stderr
  assert what in run.stderr
  no_leftovers(out)


def test_text_bad_utf8_and_long_records_fail(tmp_path):
  bad = tmp_path / "a.txt"
  data = "fine\n\nstill fine é\nbad ".encode() + b"\xff here\n"
  bad.write_bytes(data)
  out = tmp_path / "out"
  offset = data.index(b"\xff")
  for split in ("files", "lines", "paragraphs"):
    run = elevator("text", str(bad), str(out), "--split", split)
    assert run.returncode == 2
    assert run.stderr.startswith(f"elevator: error: {bad}: at byte {offset}: line 4: not "
                                 "UTF-8 (byte 0xff"), run.stderr
    no_leftovers(out)
  for split, data, offset, what in (
      ("lines", b"short\n" + b"x" * 40 + b"\n", 6,
       "line 2: a line of 40 bytes, over the limit of 30"),
      ("files", b"short\n" + b"x" * 20 + b"\n\n\nend", 0,
       "a file of 32 bytes, over the limit of 30"),
      ("paragraphs", b"end\n\n" + b"a" * 10 + b"\n" + b"b" * 10 + b"\r\n" + b"c" * 10, 5,
       "line 5: a paragraph of over 30 bytes")):
    bad.write_bytes(data)
    run = elevator("text", str(bad), str(out), "--split", split, "--max-record-bytes", "30")
    assert run.returncode == 2
    assert run.stderr.startswith(f"elevator: error: {bad}: at byte {offset}: {what}"), \
        run.stderr
    no_leftovers(out)


def test_jsonl_long_line_is_refused_before_it_is_held(tmp_path, monkeypatch):
  monkeypatch.setattr(text_lib, "_CHUNK", 64)
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"text": "a"}\n' + b"z" * 10_000)  # no newline: never a whole line
  source = JsonlSource((str(path),), max_record_bytes=100)
  with pytest.raises(CorruptInputError, match="line 2: a line of over 100 bytes") as e:
    source.index(str(path))
  assert e.value.offset == 14


def test_max_json_values_flag(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"text": "a"}\n{"text": "b", "n": [1, 2]}\n')  # 3, then 7 values
  run = elevator("jsonl", str(path), str(tmp_path / "o1"), "--max-json-values", "6")
  assert run.returncode == 2
  assert run.stderr.startswith(f"elevator: error: {path}: at byte 14: line 2: over 6 JSON "
                               "values, the limit (--max-json-values)"), run.stderr
  no_leftovers(tmp_path / "o1")
  run = elevator("jsonl", str(path), str(tmp_path / "o2"), "--max-json-values", "7")
  assert run.returncode == 0, run.stderr
  run = elevator("jsonl", str(path), str(tmp_path / "o3"), "--max-json-values", "0")
  assert run.returncode == 2 and "--max-json-values must be >= 1" in run.stderr


def test_other_field_and_arguments(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"body": "x"}\n{"body": "y", "text": 1}\n')
  out = tmp_path / "out"
  run = elevator("jsonl", str(path), str(out), "--field", "body")
  assert run.returncode == 0, run.stderr
  assert tomllib.loads(run.stdout)["datasets"]["out"]["options"]["field"] == "body"
  assert read_shards(out) == [b'{"body": "x"}', b'{"body": "y", "text": 1}']
  run = elevator("text", str(tmp_path / "none*.txt"), str(tmp_path / "o2"))
  assert run.returncode == 2 and "matches no files" in run.stderr
  (tmp_path / "blank.txt").write_bytes(b"\n \n")
  run = elevator("text", str(tmp_path / "blank.txt"), str(tmp_path / "o2"), "--split", "lines")
  assert run.returncode == 2 and "no records" in run.stderr
  no_leftovers(tmp_path / "o2")
