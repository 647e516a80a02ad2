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

import pathlib

DEFAULT_VOCAB_SIZE = 4096
END_OF_TEXT = "<|endoftext|>"


def training_text() -> list[str]:
  """The documents the tokenizer learns from, in a fixed order."""
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  return [topics[name] for name in sorted(topics)]


def train(out: str | pathlib.Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> pathlib.Path:
  """Trains the BPE and writes it as a `tokenizers` JSON file at `out`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[END_OF_TEXT])
  tokenizer.train_from_iterator(training_text(), trainer)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(out))
  return out
