"""`elevator convert`: users' data (TFRecord, image folders, Parquet, .npz,
JSON Lines, plain text) into ArrayRecord shards that `elevator serve` reads, plus the codec and the
pipeline that parse `tf.train.Example` records back (example.py).

One module per concern: shards.py (the parallel, atomic, deterministic shard
writer all converters share), one module per input format (tfrecord.py,
images.py, parquet.py, npz.py; text.py for JSON Lines and text), example.py (the Example wire format without
TensorFlow or protobuf), snippet.py (the TOML that serves the result),
cli.py (the `elevator convert` subcommands) and beam.py (the same
conversions as an Apache Beam pipeline). docs/convert.md has the formats
and guarantees.

Nothing here imports `grain_elevator.proto`, grpc or protobuf: the Beam
pipeline runs in a venv of its own (protobuf < 7) and imports these modules.
"""

from grain_elevator.tools.convert.errors import ConvertError, CorruptInputError

__all__ = ["ConvertError", "CorruptInputError"]
