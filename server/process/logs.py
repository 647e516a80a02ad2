"""Logging for the `elevator` processes: our logger only, to stderr.

The root logger is left alone so JAX's and gRPC's INFO chatter stays quiet.
"""

from __future__ import annotations

import logging
import sys


def setup(name: str = "elevator") -> None:
  logger = logging.getLogger("grain_elevator")
  logger.handlers.clear()
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False
