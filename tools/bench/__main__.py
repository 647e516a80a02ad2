"""`python -m grain_elevator.tools.bench` is `elevator bench`."""

import sys

from grain_elevator.tools.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
