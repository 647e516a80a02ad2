"""`elevator demo-lm`: a small language model trained from packed text, served.

Writes documents (CPython's reference manual, tools/text_corpus.py) as JSON
lines, trains a byte-level BPE for them (tools/tokenizer.py), and serves the
stream dataset of pipelines/text.py (tokenize, chunk, first-fit pack into
rows of LENGTH tokens with segment ids and positions) with 2 workers. A
small transformer trains on the 8-device CPU mesh from those batches, its
attention masked by segment (a packed row holds several documents: each
token sees only the earlier tokens of its own document), stops midway,
saves its parameters and the data cursor with orbax, resumes in a fresh
client, and checks that the tokens it trained on are exactly those of an
uninterrupted embedded-mode run: none lost, none repeated.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import textwrap
import time
from typing import Any

import numpy as np

LENGTH = 64  # tokens per packed row
GLOBAL_BATCH = 16
VOCAB = 512
DOCUMENTS = 2_000
D_MODEL, HEADS, LAYERS = 64, 4, 2


def write_dataset(root: pathlib.Path) -> str:
  """The documents, the tokenizer and the config; returns the config's path."""
  from grain_elevator.tools import text_corpus  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools import tokenizer  # pylint: disable=g-import-not-at-top
  text_corpus.write_jsonl_shards(str(root / "text"), DOCUMENTS, num_shards=4, seed=0)
  tokenizer.train(root / "tokenizer.json", VOCAB)
  config = root / "elevator.toml"
  config.write_text(textwrap.dedent(f"""\
      [datasets.lm]
      paths = ["text/*.array_record"]
      pipeline = "grain_elevator.pipelines.text:tokenize"
      iter_pipeline = "grain_elevator.pipelines.text:chunk_and_pack"
      seed = 1
      num_epochs = 0
      [datasets.lm.options]
      tokenizer = "tokenizer.json"
      field = "text"
      [datasets.lm.iter_options]
      length = {LENGTH}
      num_packing_bins = {GLOBAL_BATCH}
      """))
  print(f"[data]   wrote {DOCUMENTS:,} documents of CPython's reference manual as JSON "
        f"lines, and a {VOCAB}-token BPE trained on them, in {root}")
  return str(config)


class _Model:
  """A decoder-only transformer with segment-aware causal attention, trained
  with Adam; data-parallel over a 1-D mesh."""

  def __init__(self) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    self.jax = jax
    devices = jax.devices()
    # Auto sharding: XLA places the embedding lookups' gathers itself.
    self.mesh = jax.make_mesh((len(devices),), ("data",),
                              axis_types=(jax.sharding.AxisType.Auto,))
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    keys = iter(jax.random.split(jax.random.key(0), 4 + 4 * LAYERS))

    def dense(n_in: int, n_out: int) -> Any:
      return jax.random.normal(next(keys), (n_in, n_out)) / np.sqrt(n_in)

    params = {"embed": jax.random.normal(next(keys), (VOCAB, D_MODEL)) * 0.02,
              "pos": jax.random.normal(next(keys), (LENGTH, D_MODEL)) * 0.02,
              "layers": [{"qkv": dense(D_MODEL, 3 * D_MODEL), "out": dense(D_MODEL, D_MODEL),
                          "up": dense(D_MODEL, 4 * D_MODEL),
                          "down": dense(4 * D_MODEL, D_MODEL)} for _ in range(LAYERS)]}
    self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
    self.opt = jax.tree.map(lambda p: (jnp.zeros_like(p), jnp.zeros_like(p)), self.params)
    self.t = 0

    def norm(x):
      return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)

    def loss_fn(params, tokens, segments, positions):
      b, n = tokens.shape
      x = params["embed"][tokens] + params["pos"][positions]
      causal = jnp.tril(jnp.ones((n, n), bool))
      same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)
      mask = (causal[None] & same)[:, None]  # [b, 1, n, n]: its own document, earlier
      for layer in params["layers"]:
        q, k, v = jnp.split(norm(x) @ layer["qkv"], 3, -1)
        split = lambda t: t.reshape(b, n, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(D_MODEL // HEADS),
                           -1e9)
        att = jax.nn.softmax(scores, -1) @ v
        x = x + att.transpose(0, 2, 1, 3).reshape(b, n, D_MODEL) @ layer["out"]
        x = x + jax.nn.gelu(norm(x) @ layer["up"]) @ layer["down"]
      logits = norm(x) @ params["embed"].T
      # Predict each next token of the same document; padding predicts nothing.
      target = tokens[:, 1:]
      keep = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), target[..., None],
                                 -1)[..., 0]
      return jnp.sum(nll * keep) / jnp.maximum(jnp.sum(keep), 1)

    @jax.jit
    def step(params, opt, t, tokens, segments, positions):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens, segments, positions)
      b1, b2, lr = 0.9, 0.99, 3e-3

      def adam(p, g, m):
        m1, m2 = b1 * m[0] + (1 - b1) * g, b2 * m[1] + (1 - b2) * g * g
        update = (m1 / (1 - b1 ** t)) / (jnp.sqrt(m2 / (1 - b2 ** t)) + 1e-8)
        return p - lr * update, (m1, m2)

      out = jax.tree.map(adam, params, grads, opt, is_leaf=lambda x: isinstance(x, tuple))
      params = jax.tree.map(lambda o: o[0], out, is_leaf=lambda x: isinstance(x, tuple))
      opt = jax.tree.map(lambda o: o[1], out, is_leaf=lambda x: isinstance(x, tuple))
      return params, opt, loss

    self._step = step

  def step(self, batch: dict[str, Any]) -> float:
    self.t += 1
    self.params, self.opt, loss = self._step(
        self.params, self.opt, self.t, batch["tokens"], batch["tokens_segment_ids"],
        batch["tokens_positions"])
    return float(loss)


def _train(model: _Model, it, first: int, last: int, seen: list[np.ndarray],
           losses: list[float], every: int) -> None:
  t0 = time.perf_counter()
  for step in range(first, last):
    batch = next(it)
    seen.append(np.asarray(batch["tokens"]))
    losses.append(model.step(batch))
    if (step + 1) % every == 0 or step + 1 == last:
      recent = losses[-every:]
      print(f"[train]  step {step + 1:4d}  loss {sum(recent) / len(recent):6.3f}  "
            f"{(step + 1 - first) / (time.perf_counter() - t0):6.1f} steps/s", flush=True)


def run(steps: int = 120, workers: int = 2, data_dir: str | None = None) -> int:
  """Runs the demo; 0 when the resumed stream matched exactly and the loss fell."""
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import grain  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from grain_elevator.client import RemoteDataset, to_device  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top

  tmp = None
  if data_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="elevator-demo-lm-")
    data_dir = tmp.name
  root = pathlib.Path(data_dir)
  try:
    config = write_dataset(root)
    with LocalServer(config, workers=workers) as server:
      print(f"[server] serving the stream dataset 'lm' on {server.target} with {workers} "
            "worker processes")
      model = _Model()
      print(f"[mesh]   {len(jax.devices())} devices; global batch {GLOBAL_BATCH} rows of "
            f"{LENGTH} tokens, {GLOBAL_BATCH // len(jax.devices())} rows per device")
      every, half = max(1, steps // 8), steps // 2
      seen: list[np.ndarray] = []
      losses: list[float] = []

      def device_fed():
        remote = RemoteDataset(server.target, "lm", GLOBAL_BATCH)
        return remote, iter(to_device(remote, model.batch_sharding))

      remote, it = device_fed()
      _train(model, it, 0, half, seen, losses, every)
      manager = ocp.CheckpointManager(root / "checkpoints")
      manager.save(half, args=ocp.args.Composite(
          model=ocp.args.StandardSave({"params": model.params, "opt": model.opt}),
          data=grain.checkpoint.CheckpointSave(it)))
      manager.wait_until_finished()
      remote.close()
      state = (root / "checkpoints" / str(half) / "data" / "process_0-of-1.json").read_text()
      print(f"[stop]   stopped at step {half}; the data cursor: {' '.join(state.split())}")

      trainer_t = model.t
      model = _Model()  # a fresh process would start like this
      remote, it = device_fed()
      restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
          model=ocp.args.StandardRestore({"params": model.params, "opt": model.opt}),
          data=grain.checkpoint.CheckpointRestore(it)))
      model.params, model.opt = restored["model"]["params"], restored["model"]["opt"]
      model.t = trainer_t
      manager.close()
      print(f"[resume] restored; the new client resumes at step {it.get_state()['step']}")
      _train(model, it, half, steps, seen, losses, every)
      remote.close()

    with RemoteDataset.embedded(config, "lm", GLOBAL_BATCH, prefetch=0) as oracle:
      oracle_it = iter(oracle)
      want = np.concatenate([next(oracle_it)["tokens"] for _ in range(steps)])
    got = np.concatenate(seen).astype(want.dtype)
    same = np.array_equal(got, want)
    first, last = np.mean(losses[:every]), np.mean(losses[-every:])
    print(f"[check]  {steps} steps, {got.size:,} token slots: "
          f"{'0 lost, 0 repeated: identical to' if same else 'DIFFERENT from'} an "
          f"uninterrupted embedded-mode run; loss {first:.2f} -> {last:.2f}")
    return 0 if same and last < first and server.proc.returncode == 0 else 1
  finally:
    if tmp is not None:
      tmp.cleanup()
