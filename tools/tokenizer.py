"""`elevator make-tokenizer`: a byte-level BPE trained here, from text that
ships with CPython, for the text pipelines (pipelines/text.py).

The training text is CPython's own documentation as it ships with every
install (`pydoc_data.topics`: the reference manual's sections, about half a
million characters of English and Python), so nothing is downloaded and two
machines with the same Python and `tokenizers` train the same file. A real
job brings its own tokenizer file; this one makes the demo, the tests and
the benchmark's text workload self-contained.
"""

from __future__ import annotations

import os
import pathlib
import uuid

DEFAULT_VOCAB_SIZE = 4096
END_OF_TEXT = "<|endoftext|>"


class OutputError(ValueError):
  """The tokenizer cannot be written where asked: names the path and why."""


def training_text() -> list[str]:
  """The documents the tokenizer learns from, in a fixed order."""
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  return [topics[name] for name in sorted(topics)]


def check_output(out: str | pathlib.Path, replace: bool = True) -> pathlib.Path:
  """`out` as a path the tokenizer may be written to, or OutputError: not a
  folder, not an existing file unless `replace`, and in a folder that exists
  and is writable or can be made (checked before training, which takes
  seconds)."""
  out = pathlib.Path(out)
  try:
    if out.is_dir():
      raise OutputError(f"{out} is a folder: name the file to write, e.g. "
                        f"{out / 'tokenizer.json'}")
    if os.path.lexists(out) and not replace:
      raise OutputError(f"{out} exists: pass --force to replace it")
    folder = out.absolute().parent
    while not os.path.lexists(folder):  # the folders to make
      folder = folder.parent
    if not folder.is_dir():
      raise OutputError(f"cannot write {out}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
      raise OutputError(f"cannot write {out}: {folder} is not writable")
  except OSError as e:  # e.g. a name too long to look up
    raise OutputError(f"cannot write {out}: {e.strerror or e}") from e
  return out


def train(out: str | pathlib.Path, vocab_size: int = DEFAULT_VOCAB_SIZE, *,
          replace: bool = True) -> pathlib.Path:
  """Trains the BPE and writes it as a `tokenizers` JSON file at `out`
  (its folder made if missing). An existing file is replaced whole (the new
  one is written beside it, then renamed over it), or with replace=False
  refused (`elevator make-tokenizer` without --force). Raises OutputError
  where `out` cannot be written, checked before training where it can be."""
  out = check_output(out, replace)
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[END_OF_TEXT])
  tokenizer.train_from_iterator(training_text(), trainer)
  partial = out.with_name(f".tokenizer-{uuid.uuid4().hex[:8]}.partial")
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(partial))
    os.replace(partial, out)
  except Exception as e:  # pylint: disable=broad-except  # OSError, or tokenizers' "... (os error N)"
    try:
      partial.unlink(missing_ok=True)
    except OSError:
      pass
    raise OutputError(f"cannot write {out}: {e}") from e
  return out
