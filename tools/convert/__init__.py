"""`elevator convert`: users' data (TFRecord, image folders, Parquet, .npz,
JSON Lines, plain text) into ArrayRecord shards that `elevator serve` reads,
a module per input format around one shared shard writer, and as an Apache
Beam pipeline. docs/convert.md has the formats and guarantees;
docs/design.md, "pipelines/ and tools/", which module does what.

Nothing here imports `grain_elevator.proto`, grpc or protobuf: the Beam
pipeline runs in a venv of its own (protobuf < 7) and imports these modules.
"""

from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError

__all__ = ["ConvertError", "CorruptInputError"]
