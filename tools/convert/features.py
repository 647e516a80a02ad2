"""A features spec for `parse_examples` inferred from sample records: what
`elevator convert tfrecord` prints for Example records it finds."""

from __future__ import annotations

from typing import Any, Sequence

from grain_elevator.pipelines import tf_example
from grain_elevator.tools.convert import snippet as snippet_lib


def serving_from_sample(sample: Sequence[bytes]) -> snippet_lib.Serving:
  """A `parse_examples` pipeline whose features spec fits the sample records,
  or raw records if they are not all Examples."""
  try:
    parsed = [tf_example.parse_raw(r) for r in sample]
  except tf_example.ExampleError:
    parsed = []
  if not parsed or not any(parsed):
    return snippet_lib.Serving(comments=(
        "records are served as raw bytes (not tf.train.Example, or none in the sample):",
        "name a pipeline that decodes them"))
  names = sorted({n for p in parsed for n in p})
  features, notes = {}, {}
  for name in names:
    kinds = {p[name][0] for p in parsed if name in p}
    kinds.discard(None)
    kind = kinds.pop() if len(kinds) == 1 else None
    counts = {len(tf_example.values_of(*p[name])) for p in parsed if name in p}
    missing = sum(name not in p for p in parsed)
    if kind is None:
      notes[name] = "mixed or empty kinds in the sample: check"
      features[name] = {"dtype": "bytes"}
      continue
    dtype = {tf_example.BYTES: "bytes", tf_example.FLOAT: "float32", tf_example.INT64: "int64"}[kind]
    spec: dict[str, Any] = {"dtype": dtype}
    if len(counts) == 1:
      (n,) = counts
      if kind == tf_example.BYTES:
        if n == 1:
          spec["shape"] = []
      else:
        spec["shape"] = [] if n == 1 else [n]
    else:
      notes[name] = (f"{min(counts)} to {max(counts)} values per record: not batchable "
                     "as is")
    if kind == tf_example.BYTES:
      notes[name] = "bytes: decode in a further pipeline step (not servable as is)"
    if missing:
      notes[name] = f"missing from {missing} sampled records: give a default"
    features[name] = spec
  return snippet_lib.Serving(
      pipeline="grain_elevator.pipelines.tf_example:parse_examples",
      options={"features": features},
      comments=(f"tf.train.Example records; the features spec below is inferred from "
                f"{len(parsed)} sample records: check it",),
      feature_comments=notes)
