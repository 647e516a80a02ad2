"""A small real training job: device-fed batches, a jitted step, and an orbax
checkpoint of params + data iterator every `--every` steps. Restarted after a
crash, it resumes from the latest checkpoint. Each consumed step's record ids
are appended to `--log`. With `--hold-at N` it prints "AT N" once N steps are
done and waits for a line on stdin (a test kills it there). Run by
tests/client/test_crash_resume.py."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, default=40)
  p.add_argument("--checkpoint-dir", required=True)
  p.add_argument("--every", type=int, default=5)
  p.add_argument("--log", required=True)
  p.add_argument("--step-sleep", type=float, default=0.0)
  p.add_argument("--hold-at", type=int, default=-1)
  args = p.parse_args()

  import grain
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from grain_elevator.client import RemoteDataset, to_device

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  remote = RemoteDataset(args.target, args.dataset, args.global_batch_size)
  it = iter(to_device(remote, NamedSharding(mesh, P("data"))))
  params = jax.device_put({"w": jnp.zeros((4 * 4 * 3, 10)), "b": jnp.zeros(10)},
                          NamedSharding(mesh, P()))

  @jax.jit
  def train_step(params, image, label):
    def loss_fn(params):
      x = image.reshape(image.shape[0], -1).astype(jnp.float32) / 255.0
      logits = x @ params["w"] + params["b"]
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                           label[:, None], axis=1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  manager = ocp.CheckpointManager(
      pathlib.Path(args.checkpoint_dir).resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=3))
  start = manager.latest_step() or 0
  if start:
    restored = manager.restore(start, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        data=grain.checkpoint.CheckpointRestore(it)))
    params = restored["params"]
    assert it.get_state()["step"] == start, it.get_state()
    print(f"resumed from checkpoint {start}", flush=True)

  with open(args.log, "a") as log:
    step = start
    for batch in it:
      params, loss = train_step(params, batch["image"], batch["label"])
      loss.block_until_ready()
      ids = " ".join(map(str, np.asarray(batch["id"]).tolist()))
      log.write(f"{step} {ids}\n")
      log.flush()
      step += 1
      if step == args.hold_at:
        print(f"AT {step}", flush=True)
        sys.stdin.readline()
      if step % args.every == 0:
        manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
      time.sleep(args.step_sleep)
  manager.close()
  remote.close()
  print(f"finished at step {step}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
