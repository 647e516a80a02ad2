"""`elevator demo`: the whole product in one minute, with nothing set up.

Writes a small image dataset as a TFDS dataset (ArrayRecord format, written
without TensorFlow; `--format arrayrecord`: the project's own record format
with a decode pipeline), serves it with 2 worker
processes, trains a small JAX classifier whose batches are laid out on a
NamedSharding mesh of the local devices, stops the client midway, resumes a
new one from the saved cursor, and checks that no record was lost or repeated
against embedded mode.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import textwrap
import time
from typing import Any, NamedTuple

import numpy as np

from grain_elevator.proto.errors import ConfigError

IMAGE_SIDE = 8
GLOBAL_BATCH = 128


class DemoData(NamedTuple):
  """What `write_dataset` wrote: the config, and the dataset it registers,
  named for its source ("digits" or "generated")."""

  config: str
  dataset: str
  num_records: int


def _load_images(source: str) -> tuple[np.ndarray, np.ndarray, str, str]:
  """(uint8 images [N,8,8,1], labels [N], what they are, the source used)."""
  if source == "auto":
    try:
      import sklearn  # pylint: disable=g-import-not-at-top,unused-import
      source = "digits"
    except ImportError:
      source = "generated"
  if source == "digits":
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    digits = load_digits()  # bundled with scikit-learn: no download
    images = (digits.images * (255 / 16)).round().astype(np.uint8)[..., None]
    return (images, digits.target, f"scikit-learn's {len(images)} bundled 8x8 digit images",
            source)
  num_records = 10_000
  rng = np.random.default_rng(0)
  templates = rng.integers(64, 192, size=(10, IMAGE_SIDE, IMAGE_SIDE, 1))
  labels = rng.integers(10, size=num_records)
  noise = rng.integers(-128, 129, size=(num_records, IMAGE_SIDE, IMAGE_SIDE, 1))
  images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
  return images, labels, f"{num_records} generated 8x8 images of 10 classes", "generated"


def write_dataset(root: pathlib.Path, source: str, fmt: str = "auto") -> DemoData:
  """Writes the dataset + config.

  fmt "tfds": a TFDS dataset `elevator_digits` (what `tfds build
  --file_format=array_record` writes), served by name; "arrayrecord":
  shards of pipelines/examples.py's record format, decoded by its pipeline;
  "auto": tfds where tensorflow-datasets is installed.
  """
  if fmt == "auto":
    try:
      import tensorflow_datasets  # pylint: disable=g-import-not-at-top,unused-import
      fmt = "tfds"
    except ImportError:
      fmt = "arrayrecord"
  elif fmt == "tfds":
    try:
      import tensorflow_datasets  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError as e:
      raise ConfigError("--format tfds needs tensorflow-datasets: pip install "
                        "'grain-elevator[tfds]'") from e
  images, labels, what, dataset = _load_images(source)
  num_records = len(images)
  config = root / "elevator.toml"
  common = f"""\
      seed = 42
      shuffle = true
      num_epochs = 0            # repeat forever; the demo stops after --steps
      """
  if fmt == "tfds":
    from grain_elevator.tools import tfds_example  # pylint: disable=g-import-not-at-top
    folder = tfds_example.write_tfds_dataset(
        str(root / "tfds"), "elevator_digits", {"train": (images, labels)},
        num_classes=10, shards_per_split=4)
    config.write_text(textwrap.dedent(f"""\
        [datasets.{dataset}]      # a TFDS dataset by name, read without TensorFlow
        tfds = "elevator_digits"
        split = "train"
        data_dir = "tfds"
        """) + textwrap.dedent(common))
    print(f"[data]   wrote {what} as a TFDS dataset (ArrayRecord, 4 shards) in {folder}")
    return DemoData(str(config), dataset, num_records)
  # Imported here: `elevator`'s flags read run's defaults, and the record
  # format's module imports Grain, which takes seconds.
  from grain_elevator.pipelines import examples  # pylint: disable=g-import-not-at-top
  shards = root / "shards"
  examples.write_shards(
      str(shards), num_records,
      lambda i: examples.encode_record(i, int(labels[i]), images[i]),
      num_shards=4, prefix="digits")
  config.write_text(textwrap.dedent(f"""\
      [datasets.{dataset}]
      paths = ["shards/digits-*.array_record"]
      pipeline = "grain_elevator.pipelines.examples:decode_images"
      """) + textwrap.dedent(common) + textwrap.dedent(f"""\
      [datasets.{dataset}.options]
      height = {IMAGE_SIDE}
      width = {IMAGE_SIDE}
      channels = 1
      """))
  print(f"[data]   wrote {what} as 4 ArrayRecord shards in {shards}")
  return DemoData(str(config), dataset, num_records)


class _Trainer:
  """A 2-layer MLP trained with plain SGD; data-parallel over a 1-D mesh."""

  def __init__(self) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    self.jax = jax
    devices = jax.devices()
    self.mesh = jax.make_mesh((len(devices),), ("data",))
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    replicated = NamedSharding(self.mesh, P())
    k1, k2 = jax.random.split(jax.random.key(0))
    d_in, d_hidden = IMAGE_SIDE * IMAGE_SIDE, 64
    params = {
        "w1": jax.random.normal(k1, (d_in, d_hidden)) / np.sqrt(d_in),
        "b1": jnp.zeros(d_hidden),
        "w2": jax.random.normal(k2, (d_hidden, 10)) / np.sqrt(d_hidden),
        "b2": jnp.zeros(10),
    }
    self.params = jax.device_put(params, replicated)

    def loss_fn(params, image, label):
      x = image.reshape(image.shape[0], -1).astype(jnp.float32) / 255.0  # on device
      h = jax.nn.relu(x @ params["w1"] + params["b1"])
      logits = h @ params["w2"] + params["b2"]
      loss = -jnp.mean(jnp.take_along_axis(
          jax.nn.log_softmax(logits), label[:, None], axis=1))
      return loss, jnp.mean(jnp.argmax(logits, -1) == label)

    @jax.jit
    def step(params, image, label):
      (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, image, label)
      params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
      return params, loss, acc

    self._step = step

  def step(self, batch: dict[str, Any]) -> tuple[float, float]:
    self.params, loss, acc = self._step(self.params, batch["image"], batch["label"])
    return float(loss), float(acc)


def _train(trainer: _Trainer, it, first_step: int, last_step: int,
           seen_ids: list[np.ndarray], every: int) -> None:
  """Runs steps [first_step, last_step), printing progress."""
  wait = 0.0
  t0 = time.perf_counter()
  t_window, steps_window, wait_window = t0, 0, 0.0
  for step in range(first_step, last_step):
    t = time.perf_counter()
    batch = next(it)
    dt = time.perf_counter() - t
    wait += dt
    wait_window += dt
    seen_ids.append(np.asarray(batch["id"]))
    loss, acc = trainer.step(batch)
    steps_window += 1
    if (step + 1) % every == 0 or step + 1 == last_step:
      now = time.perf_counter()
      rate = steps_window / (now - t_window)
      print(f"[train]  step {step + 1:4d}  loss {loss:6.3f}  acc {acc:5.1%}  "
            f"{rate:7.1f} batches/s  data wait {wait_window / (now - t_window):5.1%}",
            flush=True)
      t_window, steps_window, wait_window = now, 0, 0.0
  total = time.perf_counter() - t0
  print(f"[train]  {last_step - first_step} steps in {total:.2f}s; waited "
        f"{wait:.2f}s for data ({wait / total:.1%} of the time)")


def run(steps: int = 200, workers: int = 2, data_dir: str | None = None,
        source: str = "auto", fmt: str = "auto") -> int:
  """Runs the demo; returns 0 when the resumed stream matched exactly."""
  # Show a mesh even on a CPU-only machine: 8 host devices, unless set already.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import grain  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset, to_device  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top

  tmp = None
  if data_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="elevator-demo-")
    data_dir = tmp.name
  root = pathlib.Path(data_dir)
  try:
    config, dataset, _ = write_dataset(root, source, fmt)
    print(f"[server] starting `elevator serve --config {config} --workers {workers}` ...")
    with LocalServer(config, workers=workers) as server:
      print(f"[server] serving on {server.target} with {workers} worker processes")
      trainer = _Trainer()
      print(f"[mesh]   {len(jax.devices())} {jax.devices()[0].platform.upper()} devices, "
            f"mesh axes {dict(trainer.mesh.shape)}; global batch {GLOBAL_BATCH} split "
            f"{GLOBAL_BATCH // len(jax.devices())} rows per device")
      every = max(1, steps // 10)
      half = steps // 2
      seen: list[np.ndarray] = []

      def device_fed() -> tuple[RemoteDataset, Any]:
        remote = RemoteDataset(server.target, dataset, GLOBAL_BATCH)
        return remote, iter(to_device(remote, trainer.batch_sharding))

      remote, it = device_fed()
      _train(trainer, it, 0, half, seen, every)
      manager = ocp.CheckpointManager(root / "checkpoints")
      manager.save(half, args=ocp.args.Composite(
          params=ocp.args.StandardSave(trainer.params),
          data=grain.checkpoint.CheckpointSave(it)))
      manager.wait_until_finished()
      remote.close()
      state = (root / "checkpoints" / str(half) / "data" / "process_0-of-1.json").read_text()
      kept = ("" if tmp is None else
              " (a temporary folder, deleted when the demo ends: --data-dir DIR keeps it)")
      print(f"[stop]   trainer stopped at step {half}; orbax checkpoint of params + "
            f"data cursor in {manager.directory}{kept}: {' '.join(state.split())}")

      trainer = _Trainer()  # a fresh process would start from scratch like this
      remote, it = device_fed()
      restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
          params=ocp.args.StandardRestore(trainer.params),
          data=grain.checkpoint.CheckpointRestore(it)))
      trainer.params = restored["params"]
      manager.close()
      print(f"[resume] restored params and cursor; new client resumes at step "
            f"{it.get_state()['step']}")
      _train(trainer, it, half, steps, seen, every)
      remote.close()

    # The uninterrupted stream, computed in-process (embedded mode).
    with RemoteDataset.embedded(config, dataset, GLOBAL_BATCH, prefetch=0) as oracle:
      oracle_it = iter(oracle)
      expected = [next(oracle_it)["id"] for _ in range(steps)]
    got = np.concatenate(seen)
    want = np.concatenate(expected).astype(got.dtype)  # int32 on devices without x64
    lost = np.setdiff1d(want, got).size
    repeated = len(got) - len(np.unique(got)) - (len(want) - len(np.unique(want)))
    same = np.array_equal(got, want)
    print(f"[check]  {steps} steps, {len(got):,} records: {lost} lost, "
          f"{max(repeated, 0)} repeated; "
          f"{'identical to' if same else 'DIFFERENT from'} an uninterrupted "
          "embedded-mode run")
    print(f"[server] stopped (exit {server.proc.returncode})")
    return 0 if same and server.proc.returncode == 0 else 1
  finally:
    if tmp is not None:
      tmp.cleanup()

