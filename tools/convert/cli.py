"""The `elevator convert` subcommands (and their arguments, which
`python -m grain_elevator.tools.convert.beam` shares)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from grain_elevator.server.data.storage.settings import DEFAULT_RETRY_S
from grain_elevator.tools.convert.errors import ConvertError

DESCRIPTION = """\
Convert a dataset into ArrayRecord shards that `elevator serve` reads, and print
the config table that serves them (also written as OUT_DIR/elevator.toml).

The shards are PREFIX-SSSSS-of-NNNNN.array_record: records in input order, cut
evenly into N shards, identical whatever --workers. Everything is written beside
OUT_DIR and renamed into place at the end: a failed or interrupted run leaves no
OUT_DIR. docs/convert.md has the record formats and guarantees."""

EPILOG = """\
examples:
  elevator convert tfrecord 'data/train-*.tfrecord' shards/train
  elevator convert images ~/imagenet/train shards/imagenet --shards 1024
  elevator convert parquet 'table/*.parquet' shards/table
  elevator convert npz 'arrays/*.npz' shards/arrays
  elevator convert jsonl 'corpus/*.jsonl.gz' shards/corpus --field text
  elevator convert text 'books/*.txt' shards/books --split paragraphs"""


def _common(p: argparse.ArgumentParser, local: bool) -> None:
  p.add_argument("out_dir", metavar="OUT_DIR",
                 help="folder to create (its name names the dataset in the printed config)")
  p.add_argument("--shards", type=int, default=None, metavar="N",
                 help="number of shards (default: one per 128 MB of input)")
  p.add_argument("--prefix", default="train",
                 help="shard file name prefix (default: train)")
  p.add_argument("--name", default=None,
                 help="dataset name in the printed config (default: OUT_DIR's name)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace an OUT_DIR that holds shards from an earlier conversion")
  p.add_argument("--upload-retry-s", type=float, default=DEFAULT_RETRY_S, metavar="S",
                 help="OUT_DIR in a bucket: how long one upload keeps retrying transient "
                      f"errors before the conversion fails (default {DEFAULT_RETRY_S:g})")
  if local:
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes (default: the usable CPU count)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_subcommands(parser: argparse.ArgumentParser, *, local: bool = True) -> None:
  """Adds the tfrecord/images/parquet/npz/jsonl/text subcommands to `parser`."""
  parser.description = DESCRIPTION
  parser.epilog = EPILOG
  parser.formatter_class = argparse.RawDescriptionHelpFormatter
  sub = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")

  p = sub.add_parser(
      "tfrecord", help="TFRecord files (e.g. of tf.train.Example), without TensorFlow",
      description="Copy TFRecord records (input files in sorted name order, records in "
                  "file order) into ArrayRecord shards, byte for byte. Both CRCs of every "
                  "record are checked; a damaged file fails naming the file and byte offset.")
  p.add_argument("inputs", nargs="+", metavar="IN_GLOB",
                 help="TFRecord files or glob patterns (quote them)")
  _common(p, local)
  p.add_argument("--compression", choices=("auto", "none", "gzip", "zlib"), default="auto",
                 help="input compression (default auto: by extension, .gz gzip, .zz zlib)")
  from grain_elevator.tools.convert.tfrecord import MAX_RECORD_BYTES  # pylint: disable=g-import-not-at-top
  p.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES,
                 help=f"refuse records larger than this (default {MAX_RECORD_BYTES >> 30} GiB)")

  p = sub.add_parser(
      "images", help="an ImageNet-style folder: DIR/<class>/<image files>",
      description="One record per JPEG/PNG file: label:int64 little-endian | the file's "
                  "bytes. Labels are the sorted class folder names (OUT_DIR/labels.txt); "
                  "records go by label, then path. Files that are not JPEG/PNG are "
                  "skipped and counted.")
  p.add_argument("input_dir", metavar="DIR", help="folder with one subfolder per class")
  _common(p, local)
  p.add_argument("--strict", action="store_true",
                 help="fail on an image-named file that is not a JPEG or PNG")

  p = sub.add_parser(
      "parquet", help="Parquet rows, each as a tf.train.Example",
      description="One tf.train.Example per row (files in sorted name order, rows in "
                  "order), one feature per column; the printed features spec gives the "
                  "columns back exactly (grain_elevator.pipelines.tf_example:"
                  "parse_examples).")
  p.add_argument("inputs", nargs="+", metavar="IN_GLOB",
                 help="Parquet files or glob patterns (quote them)")
  _common(p, local)
  from grain_elevator.tools.convert.parquet import DEFAULT_BATCH_ROWS  # pylint: disable=g-import-not-at-top
  p.add_argument("--batch-rows", type=int, default=DEFAULT_BATCH_ROWS,
                 help="rows read at a time (default %(default)s)")

  p = sub.add_parser(
      "npz", help="rows of .npz arrays, each as a tf.train.Example",
      description="One tf.train.Example per row of the arrays of each .npz (files in "
                  "sorted name order); each array's row is stored as raw bytes, so "
                  "every dtype comes back bit for bit. Never unpickles.")
  p.add_argument("inputs", nargs="+", metavar="IN_GLOB",
                 help=".npz files or glob patterns (quote them)")
  _common(p, local)

  p = sub.add_parser(
      "jsonl", help="JSON Lines, one record per line, for language models",
      description="One record per non-blank line (files in sorted name order, lines in "
                  "order): the line's bytes as they are, without its line ending (\\n or "
                  "\\r\\n). Each line must be a JSON object holding a string under "
                  "--field; a bad line fails naming the file, line and byte offset. The "
                  "printed table tokenizes and packs the text "
                  "(grain_elevator.pipelines.text).")
  p.add_argument("inputs", nargs="+", metavar="IN_GLOB",
                 help="JSON Lines files or glob patterns (quote them)")
  _common(p, local)
  p.add_argument("--field", default="text",
                 help="the JSON key holding the text (default: text)")
  from grain_elevator.tools.convert.text import MAX_JSON_VALUES  # pylint: disable=g-import-not-at-top
  p.add_argument("--max-json-values", type=int, default=MAX_JSON_VALUES, metavar="N",
                 help="refuse a line holding more JSON values: objects, arrays, keys, "
                      "strings, numbers, literals (default %(default)s; parsing takes "
                      "Python up to ~70 bytes per value, here and when serving)")
  _text_options(p)

  p = sub.add_parser(
      "text", help="plain UTF-8 text files, for language models",
      description="Plain UTF-8 text (files in sorted name order), one record per file "
                  "(its bytes, unchanged), per non-blank line or per paragraph (--split); "
                  "invalid UTF-8 fails naming the file, line and byte offset. The printed "
                  "table tokenizes and packs the text (grain_elevator.pipelines.text).")
  p.add_argument("inputs", nargs="+", metavar="IN_GLOB",
                 help="text files or glob patterns (quote them)")
  _common(p, local)
  p.add_argument("--split", choices=("files", "lines", "paragraphs"), default="files",
                 help="a record per file, per non-blank line, or per run of non-blank "
                      "lines (default: files)")
  _text_options(p)


def _text_options(p: argparse.ArgumentParser) -> None:
  p.add_argument("--compression", choices=("auto", "none", "gzip", "zlib"), default="auto",
                 help="input compression (default auto: by extension, .gz gzip, .zz zlib)")
  from grain_elevator.tools.convert.text import MAX_RECORD_BYTES  # pylint: disable=g-import-not-at-top
  p.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES,
                 help=f"refuse a longer line, paragraph or file (default "
                      f"{MAX_RECORD_BYTES >> 20} MiB)")


def make_source(args: argparse.Namespace) -> Any:
  """The Source the parsed arguments describe."""
  if args.format == "tfrecord":
    from grain_elevator.tools.convert.tfrecord import TFRecordSource  # pylint: disable=g-import-not-at-top
    return TFRecordSource(tuple(args.inputs), compression=args.compression,
                          max_record_bytes=args.max_record_bytes)
  if args.format == "images":
    from grain_elevator.tools.convert.images import ImageFolderSource  # pylint: disable=g-import-not-at-top
    return ImageFolderSource.of(args.input_dir, strict=args.strict)
  if args.format == "parquet":
    from grain_elevator.tools.convert.parquet import ParquetSource  # pylint: disable=g-import-not-at-top
    return ParquetSource(tuple(args.inputs), batch_rows=args.batch_rows)
  if args.format == "npz":
    from grain_elevator.tools.convert.npz import NpzSource  # pylint: disable=g-import-not-at-top
    return NpzSource(tuple(args.inputs))
  if args.format == "jsonl":
    from grain_elevator.tools.convert.text import JsonlSource  # pylint: disable=g-import-not-at-top
    return JsonlSource(tuple(args.inputs), compression=args.compression,
                       max_record_bytes=args.max_record_bytes, field=args.field,
                       max_json_values=args.max_json_values)
  if args.format == "text":
    from grain_elevator.tools.convert.text import TextSource  # pylint: disable=g-import-not-at-top
    return TextSource(tuple(args.inputs), compression=args.compression,
                      max_record_bytes=args.max_record_bytes, split=args.split)
  raise ConvertError(f"unknown format {args.format!r}")


def run(args: argparse.Namespace) -> int:
  """Runs a parsed `elevator convert FORMAT ...`: progress and summary on
  stderr, the config on stdout. Errors: ``elevator: error: ...``, exit 2."""
  from grain_elevator.tools.convert import shards  # pylint: disable=g-import-not-at-top
  try:
    summary = shards.convert(
        make_source(args), args.out_dir, num_shards=args.shards, workers=args.workers,
        overwrite=args.overwrite, prefix=args.prefix, name=args.name,
        progress=not args.quiet, upload_retry_s=args.upload_retry_s)
  except ConvertError as e:
    print(f"elevator: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    print("elevator: interrupted; OUT_DIR was not written", file=sys.stderr)
    return 143 if isinstance(e, shards.Terminated) else 130
  for line in summary.lines():
    print(line, file=sys.stderr)
  print(f"serve it with this table (also in {summary.out_dir}/elevator.toml):",
        file=sys.stderr)
  sys.stdout.write(summary.snippet)
  sys.stdout.flush()
  return 0
