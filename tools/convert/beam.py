"""The conversions of `elevator convert` as an Apache Beam pipeline.

  python -m grain_elevator.tools.convert.beam {tfrecord,images,parquet,npz} ARGS... \\
      --runner DirectRunner [other Beam pipeline options]

ARGS are `elevator convert`'s (no --workers: the runner decides). The
pipeline is made of the local converter's own functions (shards.py), so its
OUT_DIR is byte-identical to `elevator convert`'s: the same shard names, the
same records in the same order, the same elevator.toml and labels.txt.

  Create(input units) -> Reshuffle -> index each unit      (parallel)
    -> ToList -> plan the shards                             (one element)
    -> FlatMap(shard tasks) -> Reshuffle -> write each shard (parallel)
    -> ToList -> write side files, rename into OUT_DIR        (one element)

Shards are written into the hidden staging folder beside OUT_DIR, each under
a temporary name first (a retried or speculative task replaces it whole), and
the folder is renamed to OUT_DIR by the last step. On Dataflow, Flink or
Spark, a local OUT_DIR and the inputs must be paths every worker sees the
same (a shared or mounted file system): ArrayRecord writes local paths. An
OUT_DIR in a bucket (gs://, s3://, az://) needs no shared file system: each
worker writes its shard locally and uploads it as one object, and the last
step puts the side files and the config (bucket_out.py).

Apache Beam needs protobuf < 7, the rest of grain-elevator protobuf 7, so this
runs in a venv of its own (`make beam-venv` builds .venv-beam); nothing here
imports grain_elevator.proto or grpc.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Any, Sequence

from grain_elevator.tools.convert import cli
from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert.bucket_out import BucketStaging
from grain_elevator.tools.convert.errors import ConvertError


Staging = shards.Staging | BucketStaging


@dataclasses.dataclass(frozen=True)
class Job:
  """What every step of the pipeline needs, passed to each as one side
  argument. A concrete class on purpose: Beam checks a side argument against
  its annotation with issubclass, which a Protocol such as `shards.Source`
  refuses (apache-beam 2.78's beartype check raised TypeError on it)."""

  source: shards.Source
  staging: Staging
  num_shards: int | None
  prefix: str
  name: str

  @property
  def to_bucket(self) -> bool:
    return isinstance(self.staging, BucketStaging)


def _index(item: tuple[int, str], job: Job) -> tuple[int, str, shards.Indexed]:
  i, unit = item
  return i, unit, job.source.index(unit)


def _plan(indexes: Sequence[tuple[int, str, shards.Indexed]], job: Job) -> shards.Plan:
  ordered = [(unit, ix) for _, unit, ix in sorted(indexes, key=lambda t: t[0])]
  the_plan = shards.plan(ordered, job.source, num_shards=job.num_shards, prefix=job.prefix)
  if not job.to_bucket:  # a bucket's are local to each worker
    os.makedirs(job.staging.tmp_dir, exist_ok=True)
  return the_plan


def _tasks(the_plan: shards.Plan) -> Sequence[shards.ShardTask]:
  return the_plan.tasks


def _write(task: shards.ShardTask, job: Job) -> shards.ShardResult:
  if not isinstance(job.staging, BucketStaging):
    return shards.write_shard(job.source, task, job.staging.tmp_dir)
  with tempfile.TemporaryDirectory(prefix="elevator-shard-") as folder:
    result = shards.write_shard(job.source, task, folder)
    job.staging.upload(os.path.join(folder, task.name), task.name)
  return result


def _commit(results: Sequence[shards.ShardResult], the_plan: shards.Plan, job: Job) -> str:
  staging = job.staging
  if isinstance(staging, BucketStaging):
    os.makedirs(staging.tmp_dir, exist_ok=True)  # the side files and config, on this worker
  printed, _ = shards.finish(job.source, staging, the_plan, results, name=job.name)
  if isinstance(staging, BucketStaging):
    staging.commit(uploaded=[r.name for r in results])
  else:
    staging.commit()
  return printed


def build(pipeline: Any, job: Job) -> Any:
  """Adds the conversion to a Beam pipeline; returns the PCollection holding
  the printed config (one element, once committed)."""
  import apache_beam as beam  # pylint: disable=g-import-not-at-top
  units = list(enumerate(job.source.units()))
  plan = (pipeline
          | "Units" >> beam.Create(units)
          | "SpreadUnits" >> beam.Reshuffle()
          | "Index" >> beam.Map(_index, job)
          | "AllIndexes" >> beam.combiners.ToList()
          | "Plan" >> beam.Map(_plan, job))
  return (plan
          | "Tasks" >> beam.FlatMap(_tasks)
          | "SpreadTasks" >> beam.Reshuffle()
          | "Write" >> beam.Map(_write, job)
          | "AllShards" >> beam.combiners.ToList()
          | "Commit" >> beam.Map(_commit, beam.pvalue.AsSingleton(plan), job))


def _convert_error(e: BaseException) -> ConvertError | None:
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, ConvertError):
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m grain_elevator.tools.convert.beam",
      usage="%(prog)s FORMAT ARGS... [--runner RUNNER] [Beam pipeline options]")
  cli.add_subcommands(parser, local=False)
  parser.description = (__doc__.split("\n\n", 2)[2].split("\n\n")[0] + "\n\n"
                        + cli.DESCRIPTION.split("\n\n", 1)[1])
  args, beam_args = parser.parse_known_args(argv)
  try:
    import apache_beam as beam  # pylint: disable=g-import-not-at-top
    from apache_beam.options.pipeline_options import PipelineOptions  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("elevator: error: this needs apache-beam (make beam-venv builds .venv-beam "
          "with it)", file=sys.stderr)
    return 2
  try:
    source = cli.make_source(args)
    staging = shards.open_staging(args.out_dir, overwrite=args.overwrite,
                                  upload_retry_s=args.upload_retry_s)
    staging.check()
    if isinstance(staging, BucketStaging) and args.overwrite:
      staging.withdraw_config()  # the workers replace shards in place
    name = args.name or shards.default_name(args.out_dir)
    try:
      with beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        build(p, Job(source, staging, num_shards=args.shards, prefix=args.prefix, name=name))
    except BaseException:
      staging.abort()  # where the staging folder is visible from here
      raise
  except Exception as e:  # pylint: disable=broad-except
    error = _convert_error(e)
    if error is None:
      raise
    print(f"elevator: error: {error}", file=sys.stderr)
    return 2
  if isinstance(staging, BucketStaging):
    print(f"wrote {staging.out_dir}/; its config ({staging.url(shards.CONFIG_FILE)}):",
          file=sys.stderr)
    sys.stdout.write(staging.read_config())
    return 0
  config = os.path.join(staging.out_dir, shards.CONFIG_FILE)
  print(f"wrote {staging.out_dir}; its config ({config}, paths relative to it):",
        file=sys.stderr)
  with open(config, encoding="utf-8") as f:
    sys.stdout.write(f.read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
