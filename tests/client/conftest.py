"""Fixtures of the client's tests: the in-process servers they read from
(a start of ~0.4 s, where an `elevator serve` process takes ~5 s) and a
dataset whose frames are pooled in few rows."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from grain_elevator.client.embedded import EmbeddedBackend
from grain_elevator.pipelines import examples
import datasets


@pytest.fixture(scope="session")
def server(serve: Callable[..., Any]) -> Any:
  """The client tests' shared server: the session's in-process 2-worker one
  (serve), in place of the top conftest's `elevator serve` process (~5 s to
  start, a fresh interpreter importing Grain and JAX). The tests here only
  read from it (its `.target`); one that signals a server, kills its workers
  or reads its log starts its own."""
  return serve(workers=2)


@pytest.fixture(scope="session")
def big_rows(tmp_path_factory: pytest.TempPathFactory) -> str:
  """A config of one step dataset, "forever": 32x32x3 images (rows of 3
  KiB), shuffled, repeating forever. 32 rows a step make a frame of ~97 KiB,
  which the receive pool keeps (client/transport/buffers.py: 64 KiB and up),
  where the conftest's 4x4x3 rows took 2048 a step: 1/60 of the records to
  decode, on the server and for the oracle."""
  image = {"height": 32, "width": 32, "channels": 3}
  root = tmp_path_factory.mktemp("big-rows")
  examples.write_image_shards(str(root / "shards"), num_records=300, num_shards=2, **image)
  return datasets.write_config(root / "elevator.toml",
                               forever=datasets.images(seed=11, num_epochs=0, image=image))


@pytest.fixture(scope="session")
def big_server(serve: Callable[..., Any], big_rows: str) -> Any:
  """The session's in-process 2-worker server of big_rows."""
  return serve(big_rows, workers=2)


@pytest.fixture(scope="session")
def big_oracle(big_rows: str) -> EmbeddedBackend:
  """Embedded mode of big_rows."""
  return EmbeddedBackend(big_rows)
