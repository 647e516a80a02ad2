"""`elevator make-tokenizer` run as a command: it writes a tokenizer, never
replaces one without --force, and answers a path it cannot write with
`elevator: error: ...` (exit 2) naming it, before it trains."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grain_elevator.tools.testing.launcher import ELEVATOR

tokenizers = pytest.importorskip("tokenizers")

VOCAB = "300"  # small: the same code, trained in under a second


def make_tokenizer(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([*ELEVATOR, "make-tokenizer", *args, "--vocab-size", VOCAB],
                        capture_output=True, text=True, timeout=120, check=False)


def _refused(run: subprocess.CompletedProcess, message: str) -> None:
  assert run.returncode == 2, run.stderr
  assert run.stderr == f"elevator: error: {message}\n"  # one line, no traceback


def test_writes_and_replaces_only_with_force(tmp_path):
  out = tmp_path / "new" / "sub" / "tokenizer.json"  # missing folders are made
  run = make_tokenizer(str(out))
  assert run.returncode == 0, run.stderr
  assert tokenizers.Tokenizer.from_file(str(out)).get_vocab_size() == int(VOCAB)

  out.write_text("mine")
  _refused(make_tokenizer(str(out)), f"{out} exists: pass --force to replace it")
  assert out.read_text() == "mine"

  run = make_tokenizer(str(out), "--force")
  assert run.returncode == 0, run.stderr
  assert tokenizers.Tokenizer.from_file(str(out)).get_vocab_size() == int(VOCAB)
  assert sorted(os.listdir(out.parent)) == ["tokenizer.json"]  # no partial file left


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_is_refused(tmp_path, force):
  folder = tmp_path / "folder"
  folder.mkdir()
  _refused(make_tokenizer(str(folder), *(["--force"] if force else [])),
           f"{folder} is a folder: name the file to write, e.g. {folder}/tokenizer.json")
  assert not os.listdir(folder)


def test_a_folder_that_cannot_hold_it_is_refused(tmp_path):
  (tmp_path / "file").write_text("x")
  out = tmp_path / "file" / "sub" / "tokenizer.json"
  _refused(make_tokenizer(str(out)), f"cannot write {out}: {tmp_path / 'file'} is not a folder")
  out = tmp_path / ("x" * 300 + ".json")
  _refused(make_tokenizer(str(out)), f"cannot write {out}: File name too long")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_folder_that_is_not_writable_is_refused():
  # /proc/self refuses new files even to root (a chmod'ed folder would not).
  _refused(make_tokenizer("/proc/self/tokenizer.json"),
           "cannot write /proc/self/tokenizer.json: /proc/self is not writable")
