"""One measurement, in a process of its own: the trainer's side of a system.

`run(spec)` in a process forked for it (harness.py), or from the command
line: reads a JSON spec from argv, prints one JSON result line. Running each
measurement in a fresh process keeps the systems from sharing caches, threads
or allocator state, and lets CPU time be charged to exactly one of them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import numpy as np
import psutil

RESUME_STEP = 10**6
RESUME_TEXT_STEP = 10**5  # a stream's resume costs a restore, not arithmetic


def tree_cpu(proc: psutil.Process) -> float:
  """CPU seconds of this process and its live children (mp_prefetch workers)."""
  total = sum(proc.cpu_times()[:2])
  for child in proc.children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.Error:
      pass
  return total


def _nbytes(batch: Any) -> int:
  if isinstance(batch, dict):
    return sum(_nbytes(v) for v in batch.values())
  if isinstance(batch, (list, tuple)):
    return sum(_nbytes(v) for v in batch)
  return int(getattr(batch, "nbytes", None) or np.asarray(batch).nbytes)  # torch too


def _grain_text(spec: dict[str, Any]) -> Callable[[], Any]:
  """The text workload's pipeline in the trainer's process: the stream the
  service serves (tools/bench/text.py), with Grain's read threads and
  mp_prefetch (which packs per worker: faster, not the same stream)."""
  import grain  # pylint: disable=g-import-not-at-top
  from grain_elevator.pipelines import text  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.FLAGS.mark_as_parsed()
  o = spec["options"]

  def make():
    source = (_bucket_source(spec["bucket_source"]) if spec.get("bucket_source")
              else grain.sources.ArrayRecordDataSource(spec["files"]))
    ds = grain.MapDataset.source(source)
    ds = text.tokenize(ds.seed(1).shuffle().repeat(None), **o["options"])
    read = grain.ReadOptions(num_threads=spec["threads"], prefetch_buffer_size=max(
        1, spec["threads"]) * 2 if spec["threads"] else 0)
    it_ds = text.chunk_and_pack(ds.to_iter_dataset(read), **o["iter_options"])
    it_ds = it_ds.batch(spec["global_batch_size"], drop_remainder=True)
    if spec["mp_workers"]:
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec["mp_workers"]))
    return iter(it_ds)
  return make


def _grain_local(spec: dict[str, Any]) -> Callable[[], Any]:
  import grain  # pylint: disable=g-import-not-at-top
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.FLAGS.mark_as_parsed()
  if spec.get("pipeline") == "text":
    return _grain_text(spec)
  pipeline = examples.decode_images  # per record, as a user writes it
  if spec.get("pipeline") == "image":
    from grain_elevator.pipelines import images  # pylint: disable=g-import-not-at-top
    pipeline = images.train_pipeline

  def make():
    source = (_bucket_source(spec["bucket_source"]) if spec.get("bucket_source")
              else grain.sources.ArrayRecordDataSource(spec["files"]))
    ds = grain.MapDataset.source(source)
    ds = ds.seed(1).shuffle().repeat(None)
    ds = pipeline(ds, **spec["options"])
    ds = ds.batch(spec["global_batch_size"])
    read = grain.ReadOptions(num_threads=spec["threads"], prefetch_buffer_size=max(
        1, spec["threads"]) * 2 if spec["threads"] else 0)
    it_ds = ds.to_iter_dataset(read)
    if spec["mp_workers"]:
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec["mp_workers"]))
    return iter(it_ds)
  return make


def _bucket_source(spec: dict[str, Any]) -> Any:
  """A bucket read the ways local Grain reads one today (bench/bucket_sources.py)."""
  import os  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.bench import bucket_sources  # pylint: disable=g-import-not-at-top
  os.environ.update(spec["env"])
  if spec["kind"] == "per_record":
    return bucket_sources.PerRecordSource(spec["urls"])
  return bucket_sources.ShardCacheSource(
      spec["urls"], tempfile.mkdtemp(dir=spec["cache_root"]), spec["limit_bytes"])


def _elevator(spec: dict[str, Any]) -> Callable[[], Any]:
  from grain_elevator.client import RemoteDataset, TransportOptions  # pylint: disable=g-import-not-at-top
  client = dict(spec.get("client", {}))
  client["transport"] = TransportOptions(**client.get("transport", {}))

  def make():
    ds = RemoteDataset(spec["target"], spec["dataset"], spec["global_batch_size"], **client)
    if spec.get("torch"):  # the same batches as torch tensors (client/torch.py)
      from grain_elevator.client.torch import TorchLoader  # pylint: disable=g-import-not-at-top
      return iter(TorchLoader(ds))
    return iter(ds)
  return make


def _tfdata(spec: dict[str, Any]) -> Callable[[], Any]:
  """tf.data service (system e): TFRecord files through `distribute`."""
  from grain_elevator.tools.bench import tfdata  # pylint: disable=g-import-not-at-top
  tfdata.import_tf()  # outside `make`, as Grain's import is: not part of first batch

  build = tfdata.image_dataset if spec.get("pipeline") == "image" else tfdata.dataset

  def make():
    return tfdata.TfDataIterator(build(
        spec["files"], spec["options"], spec["global_batch_size"], target=spec.get("target"),
        shuffle_records=spec.get("shuffle_buffer"), compression=spec.get("compression")))
  return make


class _Received:
  """Batches of a bench receiver (plain TCP or the floor's), as an iterator
  of their sizes."""

  def __init__(self, rx: Any):
    self._rx = rx

  def __next__(self) -> int:
    return self._rx.next_batch()

  def close(self) -> None:
    self._rx.close()


def _receiver(spec: dict[str, Any]) -> _Received:
  from grain_elevator.tools.bench import floor, tcp  # pylint: disable=g-import-not-at-top
  if spec["system"] == "floor":
    return _Received(floor.Receiver(spec["ports"], spec["batch_bytes"]))
  return _Received(tcp.Receiver(spec["tcp_port"], spec["batch_bytes"],
                                spec.get("tcp_buffers", 1)))


def _resume(make: Callable[[], Any]) -> float | None:
  """Seconds from a new iterator + set_state(step 10^6) to its first batch."""
  t = time.perf_counter()
  it = make()
  state = it.get_state()
  key = "step" if "step" in state else "next_index" if "next_index" in state else None
  if key is None:  # mp_prefetch nests per-worker states: no single cursor
    _close(it)
    return None
  it.set_state({**state, key: RESUME_STEP})
  next(it)
  elapsed = time.perf_counter() - t
  _close(it)
  return elapsed


def _deep_state(state: Any, scale: float) -> Any:
  """`state` with every "next_index" (where the head's iterator stands)
  scaled by `scale`, and a step, if it has one, set to RESUME_TEXT_STEP: a
  position about that far into a stream, as a Grain state."""
  if isinstance(state, dict):
    out = {}
    for key, value in state.items():
      if key == "next_index" and isinstance(value, int):
        out[key] = int(value * scale)
      elif key == "step" and isinstance(value, int):
        out[key] = RESUME_TEXT_STEP
      else:
        out[key] = _deep_state(value, scale)
    return out
  return state


def _resume_text(make: Callable[[], Any], steps: int) -> float | None:
  """Seconds from a new iterator + set_state(a position about step
  RESUME_TEXT_STEP, extrapolated from where `steps` steps led) to its first
  batch. A stream has no O(1) step arithmetic, so the position is made from
  the head's index after `steps` steps, scaled."""
  it = make()
  for _ in range(steps):
    next(it)
  state = it.get_state()
  _close(it)
  if "next_index" not in json.dumps(state):
    return None  # no head position to scale
  deep = _deep_state(state, RESUME_TEXT_STEP / steps)
  t = time.perf_counter()
  it = make()
  it.set_state(deep)
  next(it)
  elapsed = time.perf_counter() - t
  _close(it)
  return elapsed


def _tokens(batch: Any) -> tuple[int, int]:
  """(tokens that are text, token slots) of a packed batch."""
  segments = np.asarray(batch["tokens_segment_ids"])
  return int(np.count_nonzero(segments)), int(segments.size)


def _close(it: Any) -> None:
  close = getattr(it, "close", None)
  if close:
    close()


def _server_cpu(pids: list[int]) -> float:
  """CPU seconds of the server's processes (and their children) so far."""
  total = 0.0
  for pid in pids:
    try:
      total += tree_cpu(psutil.Process(pid))
    except psutil.Error:
      pass
  return total


def measure(spec: dict[str, Any]) -> dict[str, Any]:
  """Builds the system's iterator, warms up, counts `seconds` of batches.

  With "server_pids" in the spec, also the CPU seconds those processes (a
  server's supervisor and workers) spent in the counted window."""
  kind = spec["system"]
  server_pids = spec.get("server_pids") or []
  if kind in ("tcp", "floor"):
    make = lambda: _receiver(spec)  # noqa: E731
    size = lambda b: b  # noqa: E731
  else:
    make = {"grain": _grain_local, "tfdata": _tfdata}.get(kind, _elevator)(spec)
    size = _nbytes
  proc = psutil.Process()
  t0 = time.perf_counter()
  it = make()
  first = next(it)
  ttfb = time.perf_counter() - t0
  batch_bytes = size(first)
  deadline = time.perf_counter() + spec["warmup_s"]
  pulled = 1  # batches taken from the system, warm-up and resume included
  while time.perf_counter() < deadline:
    next(it)
    pulled += 1
  text = spec.get("pipeline") == "text" and kind != "tcp"  # a TCP sender sends bytes, not tokens
  server0 = _server_cpu(server_pids)
  cpu0, t1 = tree_cpu(proc), time.perf_counter()
  batches, nbytes, tokens, slots = 0, 0, 0, 0
  while time.perf_counter() - t1 < spec["seconds"]:
    batch = next(it)
    nbytes += size(batch)
    batches += 1
    if text:
      real, total = _tokens(batch)
      tokens, slots = tokens + real, slots + total
  wall = time.perf_counter() - t1
  cpu = tree_cpu(proc) - cpu0
  server_cpu = _server_cpu(server_pids) - server0
  stats = getattr(it, "stats", None)  # a RemoteDataset iterator's: its window now
  window = stats().window if callable(stats) else None
  _close(it)
  pulled += batches
  records = batches * spec["global_batch_size"]
  result = {
      "records_per_s": records / wall,
      "gb_per_s": nbytes / wall / 1e9,
      "client_cpu_s_per_gb": cpu / (nbytes / 1e9),
      "client_cores": cpu / wall,
      "first_batch_s": ttfb,
      "batch_bytes": batch_bytes,
  }
  if window is not None:
    result["window"] = window
  if server_pids:
    result["server_cores"] = server_cpu / wall
  if text:
    result.update(tokens_per_s=tokens / wall, padding_fraction=1 - tokens / slots,
                  client_cpu_s_per_mtok=cpu / (tokens / 1e6),
                  resume_first_batch_s=_resume_text(make, 8))
    if server_pids:
      result["server_cpu_s_per_mtok"] = server_cpu / (tokens / 1e6)
    return result
  if kind == "tfdata":  # tf.data service iterators cannot be saved or restored
    result["resume_first_batch_s"] = None
  elif kind not in ("tcp", "floor"):
    result["resume_first_batch_s"] = _resume(make)
    pulled += 1
  result["records_total"] = pulled * spec["global_batch_size"]
  return result


def run(spec: dict[str, Any]) -> dict[str, Any]:
  """`measure`, after glibc's tunables where the spec asks for them (as the
  server's workers get them)."""
  if spec.get("tune_malloc"):
    from grain_elevator.proto.malloc import tune_malloc  # pylint: disable=g-import-not-at-top
    assert tune_malloc()
  return measure(spec)


def main() -> int:
  print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
