"""Regenerates the committed gRPC stubs from elevator.proto.

The stubs are committed so that a plain ``pip install .`` needs no protoc;
``tests/proto/test_wire.py`` fails when they drift from the .proto.

Usage: ``python -m grain_elevator.proto.generate [--check]``
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
GENERATED = ("elevator_pb2.py", "elevator_pb2.pyi", "elevator_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> dict[str, str]:
  """Runs protoc on elevator.proto; returns {file name: generated text}."""
  try:
    from grpc_tools import protoc  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(
        "grpcio-tools is needed to regenerate the stubs: "
        "pip install 'grain-elevator[test]'"
    ) from e
  # The virtual path makes the generated imports read
  # `from grain_elevator.proto import elevator_pb2`.
  args = [
      "protoc",
      f"-Igrain_elevator/proto={PROTO_DIR}",
      f"--python_out={out_dir}",
      f"--pyi_out={out_dir}",
      f"--grpc_python_out={out_dir}",
      str(PROTO_DIR / "elevator.proto"),
  ]
  if protoc.main(args) != 0:
    raise SystemExit("protoc failed on elevator.proto")
  gen = out_dir / "grain_elevator" / "proto"
  return {name: (gen / name).read_text() for name in GENERATED}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--check", action="store_true",
      help="exit 1 if the committed stubs differ from freshly generated ones",
  )
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    fresh = generate(pathlib.Path(tmp))
  stale = [n for n, text in fresh.items()
           if not (PROTO_DIR / n).exists() or (PROTO_DIR / n).read_text() != text]
  if args.check:
    for name in stale:
      print(f"stale: proto/{name} (run `make proto`)", file=sys.stderr)
    return 1 if stale else 0
  for name in stale:
    (PROTO_DIR / name).write_text(fresh[name])
    print(f"wrote proto/{name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
