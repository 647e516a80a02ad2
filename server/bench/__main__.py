"""`python -m grain_elevator.server.bench` is `elevator bench`."""

import sys

from grain_elevator.server.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
