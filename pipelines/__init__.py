"""Runtime code that configs name: record formats and ready pipelines, and
the names a pipeline author needs.

A dataset's ``pipeline`` and ``batch_transform`` (``"package.module:function"``
in the server's TOML) run inside every worker process and in embedded mode,
so they are library code, imported by the serving side, never tools:

  examples.py    a small fixed-size image record format, its pipelines and a
                 shard writer (the demo, the tests, the benchmark)
  images.py      encoded images (JPEG, PNG) and their decode-crop-flip
                 training pipeline; what ``elevator convert images`` writes
  tf_example.py  ``tf.train.Example`` records without TensorFlow, parsed by a
                 features spec (``parse_examples``)
  text.py        text for language models: tokenize, chunk, pack (a stream
                 dataset)

A pipeline of your own imports what it needs from here:

    from grain_elevator.pipelines import DataLossError, RowStack

    def decode_batch(raw_records, *, size):
      ...
      return {"image": RowStack(rows), "label": labels}

``RowStack`` hands a batch leaf's rows to the socket unstacked (one copy
fewer for big rows); ``DataLossError`` marks a record that cannot be decoded
(clients see DATA_LOSS naming the dataset and step, and every other step is
still served); ``ConfigError`` refuses bad options when the server starts;
``config_path`` resolves a file an option names (a tokenizer, a vocabulary)
relative to the config file's folder, as `paths` are.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from typing import TYPE_CHECKING, Any, Iterator

from grain_elevator.proto.rows import MIN_ROW_BYTES, RowStack

if TYPE_CHECKING:
  from grain_elevator.proto.errors import ConfigError, DataLossError

__all__ = ["RowStack", "MIN_ROW_BYTES", "DataLossError", "ConfigError", "config_path"]

# The folder of the config whose pipeline is being built (set by the server).
_CONFIG_DIR: contextvars.ContextVar[str] = contextvars.ContextVar("config_dir", default="")


def config_path(path: str) -> str:
  """`path` from a pipeline's options, absolute: relative paths are taken
  from the folder of the config that names the pipeline (as its `paths`
  are), or the working directory outside a server."""
  path = os.path.expanduser(path)
  return os.path.abspath(os.path.join(_CONFIG_DIR.get(), path))


@contextlib.contextmanager
def building_from(config_dir: str) -> Iterator[None]:
  """While a config's pipelines are built: `config_path` resolves there."""
  token = _CONFIG_DIR.set(config_dir)
  try:
    yield
  finally:
    _CONFIG_DIR.reset(token)


def __getattr__(name: str) -> Any:
  """The errors, imported on first use: they load grpc (their status codes),
  which the converter's Beam environment, importing tf_example, does without."""
  if name in ("ConfigError", "DataLossError"):
    value = getattr(importlib.import_module("grain_elevator.proto.errors"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'grain_elevator.pipelines' has no attribute {name!r}")
