"""Pipelines that wait: many busy server workers, emulated on a few cores.

A client's defaults must keep every worker of a big server busy, but this
machine has 2 cores: 16 workers doing real work would share them and run
no faster than 2. A worker that sleeps for each record instead is busy
without taking a core, as a worker on a 16-core server is busy on a core of
its own (its requests sleep in turn, as they would compute in turn), so a
client must keep as many requests in flight to keep it fed.
Each pipeline here is a bench workload's own (the same records, the same
shapes; the image's decode and crop replaced by a cheap stand-in) with
`sleep_us_per_record` microseconds of waiting per record. `config` writes a
server config whose datasets carry the workloads' names:

    [datasets.small]
    paths = ["small/*.array_record"]
    pipeline = "grain_elevator.tools.bench.sleeping:pixels"
    batch_transform = "grain_elevator.tools.bench.sleeping:pixels_batch"
    [datasets.small.options]
    sleep_us_per_record = 200
    ...
"""

from __future__ import annotations

import functools
import os
import pathlib
import random
import threading
import time
from typing import Any

import numpy as np

from grain_elevator.pipelines import examples
from grain_elevator.pipelines import images as images_lib
from grain_elevator.tools.bench import costly

# Microseconds each record waits when the bench is not told otherwise: 16
# such workers produce about 100 MB/s of the workload's batches (its
# delivered bytes per record x 16 / 100 MB/s), well under what the client
# and the server's own work (decode, send) manage on a share of this
# machine's 2 busy cores, so that the requests in flight decide the rate.
# The costly workload's records are cheap bytes that cost their worker
# time: they wait as long as its real pipeline computes.
DEFAULT_SLEEP_US = {"small": 2_000, "large": 25_000, "image": 24_000, "text": 5_000,
                    "costly": costly.WORK_US_PER_RECORD}

# A worker has one core: its requests wait in turn, as they would compute in
# turn, so a second request in flight hides a round trip and a send but
# does not double what the worker makes.
_CORE = threading.Lock()


_speed: float | None = None


def _sleep(seconds: float) -> None:
  """`seconds`, times this worker's own factor in [0.9, 1.1]: workers of
  one speed, started together, would finish their requests in waves, which
  a measurement of a few seconds cuts anywhere; cores differ that much."""
  global _speed
  if _speed is None:  # per process (not at import: a fork would share it)
    _speed = random.Random(os.getpid()).uniform(0.9, 1.1)
  with _CORE:
    time.sleep(seconds * _speed)


def _wait(record: Any, *, us: float) -> Any:
  _sleep(us / 1e6)
  return record


def pixels(ds: Any, *, sleep_us_per_record: float, **options: Any) -> Any:
  """examples.decode_images, each record waiting `sleep_us_per_record`."""
  return examples.decode_images(ds, **options).map(
      functools.partial(_wait, us=sleep_us_per_record))


def pixels_batch(raw: list[bytes], *, sleep_us_per_record: float, **options: Any) -> Any:
  """examples.decode_images_batch (the same rows), after the batch's wait."""
  _sleep(len(raw) * sleep_us_per_record / 1e6)
  return examples.decode_images_batch(raw, **options)


def _image(raw: bytes, *, size: int) -> dict[str, Any]:
  """An image record's label and size x size x 3 pixels made of its bytes
  (no decode: what a decode and crop would deliver, at a fraction of the CPU)."""
  label, data = images_lib.decode_image_record(raw)
  pixels_ = np.resize(np.frombuffer(data, dtype=np.uint8), (size, size, 3))
  return {"image": pixels_, "label": np.int64(label)}


def image(ds: Any, *, sleep_us_per_record: float, size: int = 224) -> Any:
  """Image records -> {"image": uint8[size, size, 3], "label": int64}, as
  images.train_pipeline delivers them, each record waiting instead of decoding."""
  return ds.map(functools.partial(_image, size=size)).map(
      functools.partial(_wait, us=sleep_us_per_record))


def tokenize(ds: Any, *, sleep_us_per_record: float, **options: Any) -> Any:
  """pipelines.text.tokenize, each document waiting `sleep_us_per_record`
  (the stream's head: the server spreads it over its workers)."""
  from grain_elevator.pipelines import text  # pylint: disable=g-import-not-at-top
  return text.tokenize(ds, **options).map(functools.partial(_wait, us=sleep_us_per_record))


def config(root: pathlib.Path, name: str, sleep_us_per_record: float, *,
           options: dict[str, Any], iter_options: dict[str, Any] | None = None) -> str:
  """Writes root/NAME-sleeping.toml: dataset NAME over root/NAME's shards
  through the sleeping pipeline of its kind; returns its path."""
  module = "grain_elevator.tools.bench.sleeping"
  kind = {"small": "pixels", "large": "pixels", "image": "image", "text": "tokenize",
          "costly": "pixels"}[name]
  lines = [f"[datasets.{name}]", f'paths = ["{name}/*.array_record"]',
           f'pipeline = "{module}:{kind}"']
  if kind == "pixels":
    lines.append(f'batch_transform = "{module}:pixels_batch"')
  if iter_options is not None:
    lines.append('iter_pipeline = "grain_elevator.pipelines.text:chunk_and_pack"')
  lines += ["seed = 1", "num_epochs = 0", f"[datasets.{name}.options]",
            f"sleep_us_per_record = {sleep_us_per_record}"]
  lines += [f"{k} = {_toml(v)}" for k, v in options.items()]
  if iter_options is not None:
    lines.append(f"[datasets.{name}.iter_options]")
    lines += [f"{k} = {_toml(v)}" for k, v in iter_options.items()]
  path = root / f"{name}-sleeping.toml"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def _toml(value: Any) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, str):
    return f'"{value}"'
  return str(value)
