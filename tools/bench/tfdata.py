"""System (e): tf.data service, the peer a TensorFlow user would reach for.

The same records, stored as TFRecord, served by one dispatcher and W worker
processes, read by a trainer in a third process through the `distribute` op.
TensorFlow is an optional extra, so nothing here imports it at module level.

    python -m grain_elevator.tools.bench.tfdata dispatcher --port-file F
    python -m grain_elevator.tools.bench.tfdata worker --dispatcher-port P --port-file F
    python -m grain_elevator.tools.bench.tfdata smoke --data-dir D --workload small

TensorFlow's data servers listen on 0.0.0.0 (hard-coded in its server_lib);
everything here only ever connects to localhost.

TensorFlow may live in another Python environment than grain-elevator's (its
protobuf pins can clash with ours): ELEVATOR_BENCH_TF_PYTHON names that
interpreter, and every TensorFlow process of the benchmark (TFRecord writer,
dispatcher, workers, trainer) runs under it. It must import grain_elevator
too (for instance a venv with tensorflow-cpu whose .pth file adds this
environment's site-packages with `site.addsitedir`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from grain_elevator.tools.bench import portfile

if TYPE_CHECKING:
  import tensorflow as tf
  from grain_elevator.tools.bench.workloads import Workload

MODULE = "grain_elevator.tools.bench.tfdata"
TF_PYTHON_ENV = "ELEVATOR_BENCH_TF_PYTHON"
READY_TIMEOUT_S = 60.0
SHUFFLE_BUFFER = 10_000
SHUFFLE_BUFFER_BYTES = 256 << 20
_HEADER_BYTES = 16  # examples.py: id:int64 | label:int64


def import_tf() -> Any:
  """Imports TensorFlow with its INFO chatter off (warnings and errors stay)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  import tensorflow  # pylint: disable=g-import-not-at-top
  return tensorflow


def python() -> str:
  """The interpreter that runs TensorFlow: $ELEVATOR_BENCH_TF_PYTHON, or this one."""
  return os.environ.get(TF_PYTHON_ENV) or sys.executable


def available() -> bool:
  """Whether `python()` can import TensorFlow (asked without importing it here)."""
  if python() == sys.executable:
    import importlib.util  # pylint: disable=g-import-not-at-top
    return importlib.util.find_spec("tensorflow") is not None
  try:
    return subprocess.run([python(), "-c", "import tensorflow, grain_elevator"],
                          capture_output=True, timeout=120).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def _tf_here() -> bool:
  return python() == sys.executable


# --- data -------------------------------------------------------------------

def prepare_tfrecords(root: pathlib.Path, w: Workload) -> list[str]:
  """Copies the workload's ArrayRecord shards, record for record, to TFRecord.

  One file per shard, raw record bytes (tf.data reads them as they are, like
  the server does). Cached behind a marker naming the record count, so a run
  with a different count rewrites them, as `workloads.prepare` does.
  """
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.bench import workloads  # pylint: disable=g-import-not-at-top
  sources = workloads.shard_files(root, w)
  if not sources:
    raise FileNotFoundError(f"no ArrayRecord shards for {w.name!r} in {root / w.name}: "
                            "run workloads.prepare first")
  out = root / f"{w.name}-tfrecord"
  targets = [os.fspath(out / (pathlib.Path(s).name.removesuffix(".array_record") + ".tfrecord"))
             for s in sources]
  counts = []
  for s in sources:
    reader = ArrayRecordReader(s)
    counts.append(reader.num_records())
    reader.close()
  marker = out / f".complete-{sum(counts)}"
  if marker.exists() and all(os.path.exists(t) for t in targets):
    return targets
  if not _tf_here():  # TensorFlow lives in another environment: write them there
    subprocess.run([python(), "-m", MODULE, "tfrecords", "--data-dir", os.fspath(root),
                    "--workload", w.name], check=True, stdin=subprocess.DEVNULL)
    return targets
  tf = import_tf()
  out.mkdir(parents=True, exist_ok=True)
  for old in [*out.glob("*.tfrecord"), *out.glob(".complete-*")]:
    old.unlink()
  for source, target, n in zip(sources, targets, counts):
    reader = ArrayRecordReader(source)
    with tf.io.TFRecordWriter(target) as writer:
      for start in range(0, n, 1024):  # bounded memory for the 150 KiB records
        for record in reader.read(list(range(start, min(start + 1024, n)))):
          writer.write(record)
    reader.close()
  marker.touch()
  return targets


def shuffle_buffer(options: dict[str, Any]) -> int:
  """Records in each worker's shuffle buffer: 10,000, capped at 256 MiB of them.

  tf.data has no global shuffle: files are interleaved in a random order and
  raw records (before decode) pass through a bounded buffer. The cap keeps
  two workers of 150 KiB records from holding 1.5 GB each (it gives 1,747).
  """
  record = _HEADER_BYTES + options["height"] * options["width"] * options["channels"]
  return max(1, min(SHUFFLE_BUFFER, SHUFFLE_BUFFER_BYTES // record))


def dataset(files: Sequence[str], options: dict[str, Any], global_batch_size: int, *,
            target: str | None, shuffle_records: int | None = None,
            compression: str | None = None) -> tf.data.Dataset:
  """The pipeline a tf.data user writes for the contract, as near as it allows.

  Repeat forever, shuffle (file order + a record buffer; no global shuffle),
  decode as examples.decode_images does (uint8 image, or float32/255), batch G,
  then hand everything before `distribute` to the service. `target=None`
  builds the same pipeline in-process (local tf.data). No seeds: in
  parallel_epochs every worker runs this graph, and equal seeds would make
  them all send the same records. parallel_epochs ("off" sharding): each
  worker runs its own endless stream and the trainer takes from all of them.
  Compression defaults to off (None); "AUTO" (Snappy) halved large-record
  GB/s here and cost small records ~20% (BENCHMARKS.md).
  """
  tf = import_tf()
  height, width, channels = options["height"], options["width"], options["channels"]
  pixels = height * width * channels
  normalize = bool(options.get("normalize", False))

  def decode(raw: tf.Tensor) -> dict[str, tf.Tensor]:
    header = tf.io.decode_raw(tf.strings.substr(raw, 0, _HEADER_BYTES), tf.int64,
                              little_endian=True)
    image = tf.reshape(tf.io.decode_raw(tf.strings.substr(raw, _HEADER_BYTES, pixels),
                                        tf.uint8), (height, width, channels))
    if normalize:
      image = tf.cast(image, tf.float32) / 255.0
    return {"id": header[0], "label": header[1], "image": image}

  auto = tf.data.AUTOTUNE
  ds = tf.data.Dataset.from_tensor_slices(list(files)).shuffle(len(files)).repeat()
  ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files),
                     num_parallel_calls=auto, deterministic=False)
  ds = ds.shuffle(shuffle_records or shuffle_buffer(options))
  ds = ds.map(decode, num_parallel_calls=auto, deterministic=False)
  ds = ds.batch(global_batch_size, drop_remainder=True)
  if target is not None:
    ds = ds.apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=target, compression=compression))
  return ds.prefetch(auto)


IMAGE_RECORD_BYTES = 114_000  # pipelines/images.py's synthetic records, on average


def image_dataset(files: Sequence[str], options: dict[str, Any], global_batch_size: int, *,
                  target: str | None, shuffle_records: int | None = None,
                  compression: str | None = None) -> tf.data.Dataset:
  """The image workload as a tf.data user writes it, with TensorFlow's own ops.

  Records are pipelines/images.py's (int64 label | JPEG bytes). `tf.io.decode_jpeg`
  (RGB), an Inception-style crop from `tf.image.sample_distorted_bounding_box`
  (area 0.08-1 of the image, aspect 3/4-4/3, 10 attempts, then the whole
  image), bilinear `tf.image.resize` to size x size rounded back to uint8,
  `random_flip_left_right`; {"image": uint8[size, size, 3], "label": int64},
  batched G. Shuffle, repeat and `distribute` as in `dataset`; the shuffle
  buffer holds 10,000 records capped at 256 MiB (~2,350 of ~114 KB).
  """
  tf = import_tf()
  size = int(options.get("size", 224))
  whole = tf.constant([0.0, 0.0, 1.0, 1.0], shape=(1, 1, 4))

  def augment(raw: tf.Tensor) -> dict[str, tf.Tensor]:
    label = tf.io.decode_raw(tf.strings.substr(raw, 0, 8), tf.int64, little_endian=True)[0]
    image = tf.io.decode_jpeg(tf.strings.substr(raw, 8, tf.strings.length(raw) - 8),
                              channels=3)
    begin, crop, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=whole, min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    image = tf.image.resize(tf.slice(image, begin, crop), (size, size), method="bilinear")
    image = tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)
    return {"image": tf.image.random_flip_left_right(image), "label": label}

  buffer = shuffle_records or max(1, min(SHUFFLE_BUFFER,
                                         SHUFFLE_BUFFER_BYTES // IMAGE_RECORD_BYTES))
  auto = tf.data.AUTOTUNE
  ds = tf.data.Dataset.from_tensor_slices(list(files)).shuffle(len(files)).repeat()
  ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files),
                     num_parallel_calls=auto, deterministic=False)
  ds = ds.shuffle(buffer)
  ds = ds.map(augment, num_parallel_calls=auto, deterministic=False)
  ds = ds.batch(global_batch_size, drop_remainder=True)
  if target is not None:
    ds = ds.apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=target, compression=compression))
  return ds.prefetch(auto)


class TfDataIterator:
  """Numpy batches of `dataset`; `close` drops the TF iterator, which releases
  its job on the service so workers stop filling buffers for a gone trainer."""

  def __init__(self, ds: tf.data.Dataset):
    self._it = ds.as_numpy_iterator()

  def __iter__(self) -> "TfDataIterator":
    return self

  def __next__(self) -> dict[str, Any]:
    return next(self._it)

  def close(self) -> None:
    self._it = None
    gc.collect()


def consume_spec(w: Workload, target: str, files: list[str]) -> dict[str, Any]:
  """consume.py's spec for kind "tfdata" (run.py adds seconds and warmup_s).

  Optional keys: "shuffle_buffer" (records; default `shuffle_buffer`),
  "compression" (None, or "AUTO" for Snappy), and "target": None to measure
  the same pipeline as local in-process tf.data.
  """
  spec = {"system": "tfdata", "workload": w.name, "target": target, "files": files,
          "options": w.options, "global_batch_size": w.global_batch_size}
  if w.kind == "image":
    spec["pipeline"] = "image"
  return spec


# --- servers ----------------------------------------------------------------

class TfDataService:
  """One dispatcher and `workers` worker processes on localhost.

  Separate processes, as the service is deployed, so the trainer process is
  charged only for its own CPU. Each child writes its bound port to a file
  once started (a worker only after registering with the dispatcher).
  """

  def __init__(self, workers: int, *, timeout_s: float = READY_TIMEOUT_S):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    self._dir = pathlib.Path(tempfile.mkdtemp(prefix="tfdata-service-"))
    self._procs: list[tuple[str, subprocess.Popen, pathlib.Path]] = []
    self.startup_s: float = 0.0
    self._timeout_s = timeout_s
    t0 = time.monotonic()
    try:
      self.port = self._wait(self._spawn("dispatcher", []), time.monotonic() + timeout_s)
      args = ["--dispatcher-port", str(self.port)]
      started = [self._spawn(f"worker-{i}", args) for i in range(workers)]
      deadline = time.monotonic() + timeout_s  # all at once: each imports TF for ~3 s
      for child in started:
        self._wait(child, deadline)
    except BaseException:
      self.stop()
      raise
    self.startup_s = time.monotonic() - t0
    self.target = f"grpc://localhost:{self.port}"

  def _spawn(self, name: str, args: list[str]) -> tuple[str, subprocess.Popen, pathlib.Path]:
    log = self._dir / f"{name}.log"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")}
    with open(log, "wb") as err:
      proc = subprocess.Popen(
          [python(), "-m", MODULE, name.split("-")[0], "--port-file", str(self._dir / f"{name}.port"),
           "--parent-pid", str(os.getpid()), *args],
          stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=env)
    self._procs.append((name, proc, log))
    return name, proc, log

  def _wait(self, child: tuple[str, subprocess.Popen, pathlib.Path], deadline: float) -> int:
    """The child's port once its port file appears; its log tail if it dies or stalls."""
    name, proc, log = child
    port = portfile.wait(self._dir / f"{name}.port", proc, deadline)
    if port is None:
      why = (f"exited with {proc.returncode}" if proc.poll() is not None
             else f"not ready after {self._timeout_s:.0f} s")
      raise RuntimeError(f"tf.data service {name} {why}; its log ends:\n{_tail(log)}")
    return port

  def pids(self) -> list[int]:
    """The dispatcher's and workers' process ids (for their CPU time)."""
    return [proc.pid for _, proc, _ in self._procs]

  def logs(self) -> dict[str, str]:
    """Each child's output so far (TensorFlow warnings and errors)."""
    return {name: _tail(log) for name, _, log in self._procs}

  def stop(self) -> None:
    """Kills and reaps every child (workers first); safe to call twice."""
    for _, proc, _ in reversed(self._procs):
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    self._procs.clear()
    shutil.rmtree(self._dir, ignore_errors=True)

  def __enter__(self) -> "TfDataService":
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()


def _tail(path: pathlib.Path, chars: int = 3000) -> str:
  try:
    return path.read_bytes()[-chars:].decode(errors="replace")
  except OSError:
    return "(no log)"


def _exit_with_parent(parent_pid: int) -> None:
  """A child whose parent died (no stop() ran) exits instead of lingering."""
  def watch() -> None:
    while True:
      if os.getppid() != parent_pid:
        os._exit(0)
      time.sleep(1.0)
  if parent_pid:
    threading.Thread(target=watch, daemon=True).start()


def serve_dispatcher(port_file: str, parent_pid: int = 0) -> None:
  tf = import_tf()
  service = tf.data.experimental.service
  # Short job GC, so a finished measurement's job is dropped before the next.
  server = service.DispatchServer(service.DispatcherConfig(
      port=0, protocol="grpc", job_gc_check_interval_ms=1000, job_gc_timeout_ms=5000))
  _exit_with_parent(parent_pid)
  portfile.write(port_file, int(server.target.rsplit(":", 1)[1]))
  server.join()


def serve_worker(dispatcher_port: int, port_file: str, parent_pid: int = 0) -> None:
  tf = import_tf()
  service = tf.data.experimental.service
  # 1 s heartbeats (default 30 s): a released job's task leaves this worker
  # within seconds, instead of running on into the next system's measurement.
  server = service.WorkerServer(service.WorkerConfig(
      dispatcher_address=f"localhost:{dispatcher_port}", worker_address="localhost:%port%",
      port=0, protocol="grpc", heartbeat_interval_ms=1000))
  _exit_with_parent(parent_pid)
  portfile.write(port_file, int(server._address.rsplit(":", 1)[1]))  # pylint: disable=protected-access
  server.join()


def smoke(data_dir: str, workload: str, workers: int, seconds: float, warmup_s: float,
          records: int | None) -> dict[str, Any]:
  """Prepares data, starts a service, runs consume.py once in a fresh process."""
  from grain_elevator.tools.bench import workloads  # pylint: disable=g-import-not-at-top
  w = workloads.WORKLOADS[workload]
  root = pathlib.Path(data_dir)
  workloads.prepare(root, w, records or w.default_records)
  files = prepare_tfrecords(root, w)
  workloads.warm_page_cache(files)
  with TfDataService(workers) as svc:
    spec = {**consume_spec(w, svc.target, files), "seconds": seconds, "warmup_s": warmup_s}
    out = subprocess.run([python(), "-m", "grain_elevator.tools.bench.consume",
                          json.dumps(spec)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
      raise RuntimeError(f"consume failed:\n{out.stderr[-3000:]}")
    return {"workers": workers, "service_startup_s": svc.startup_s,
            **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.tfdata",
                              description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  disp = sub.add_parser("dispatcher", help="run a tf.data service dispatcher")
  work = sub.add_parser("worker", help="run a tf.data service worker")
  work.add_argument("--dispatcher-port", type=int, required=True)
  for server in (disp, work):
    server.add_argument("--port-file", required=True,
                        help="written with the bound port once started")
    server.add_argument("--parent-pid", type=int, default=0, help="exit when this parent dies")
  rec = sub.add_parser("tfrecords", help="write a prepared workload's shards as TFRecord")
  rec.add_argument("--data-dir", required=True)
  rec.add_argument("--workload", choices=("small", "large", "image"), required=True)
  sm = sub.add_parser("smoke", help="one short measurement of system (e), W workers")
  sm.add_argument("--data-dir", required=True)
  sm.add_argument("--workload", choices=("small", "large", "image"), default="small")
  sm.add_argument("--workers", type=int, default=1)
  sm.add_argument("--records", type=int, default=None)
  sm.add_argument("--seconds", type=float, default=3.0)
  sm.add_argument("--warmup-s", type=float, default=1.0)
  a = p.parse_args(argv)
  if a.cmd == "dispatcher":
    serve_dispatcher(a.port_file, a.parent_pid)
  elif a.cmd == "worker":
    serve_worker(a.dispatcher_port, a.port_file, a.parent_pid)
  elif a.cmd == "tfrecords":
    from grain_elevator.tools.bench import workloads  # pylint: disable=g-import-not-at-top
    os.environ.pop(TF_PYTHON_ENV, None)  # this process is the one with TensorFlow
    prepare_tfrecords(pathlib.Path(a.data_dir), workloads.WORKLOADS[a.workload])
  else:
    print(json.dumps(smoke(a.data_dir, a.workload, a.workers, a.seconds, a.warmup_s,
                           a.records)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
