"""Fixtures of the client's tests."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest


@pytest.fixture
def grain_elevator_logs(caplog: pytest.LogCaptureFixture
                        ) -> Iterator[pytest.LogCaptureFixture]:
  """caplog at INFO for grain_elevator's loggers (the client's, and an
  in-process server's supervisor thread), reaching it even after a test of
  this process ran the CLI: cli.main's logs.setup stops their propagation
  to the root logger, where caplog listens."""
  logger = logging.getLogger("grain_elevator")
  propagate = logger.propagate
  logger.propagate = True
  caplog.set_level(logging.INFO, logger="grain_elevator")
  yield caplog
  logger.propagate = propagate
