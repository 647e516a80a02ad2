"""docs/client.md's MaxText block on an 8-device CPU mesh, checked.

Run from tests/client/test_trainer_loaders.py by a Python >= 3.12 that has
MaxText 0.2.5 and this package's client (MaxText needs that Python), with
XLA_FLAGS giving 8 CPU devices. The block runs as it stands in the docs,
given `targets` and a "train" dataset of global batch 1024 (here: the test
server, "aug2" of global batch `--global-batch-size`). Each global array
must be the global batch the test computed in embedded mode (`--want`, an
.npz of `<key>/<step>` arrays); the state of its `local_iterator`, restored
into a new loader, must continue at the next step; `close()` must raise
nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax
import numpy as np

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "client.md"


def _block() -> str:
  """The docs' MaxText block, up to the trainer's `...`."""
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  (block,) = [b for b in blocks if "MultiHostDataLoadIterator" in b]
  return block.split("\n...\n")[0]


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", required=True)
  p.add_argument("--dataset", default="aug2")
  p.add_argument("--global-batch-size", type=int, required=True)
  p.add_argument("--want", required=True, help=".npz of the global batches, <key>/<step>")
  a = p.parse_args()
  assert jax.device_count() == 8, jax.devices()
  want = np.load(a.want)
  block = _block().replace('"train", global_batch_size=1024',
                           f'{a.dataset!r}, global_batch_size={a.global_batch_size}')
  names: dict = {"targets": a.target}
  exec(compile(block, f"{DOC}:MaxText", "exec"), names)  # pylint: disable=exec-used

  def check(batch, step):
    keys = sorted(k.split("/")[0] for k in want.files if k.endswith(f"/{step}"))
    assert sorted(batch) == keys, (sorted(batch), keys)
    for key, array in batch.items():
      assert len(array.sharding.device_set) == 8, (key, array.sharding)
      np.testing.assert_array_equal(np.asarray(array), want[f"{key}/{step}"],
                                    err_msg=f"{key} step {step}")

  data_iterator = names["data_iterator"]
  check(names["batch"], 0)
  for step in (1, 2):
    check(next(data_iterator), step)
  state = data_iterator.local_iterator.get_state()
  data_iterator.close()

  remote = names["RemoteDataset"](a.target, a.dataset, a.global_batch_size)
  again = names["MultiHostDataLoadIterator"](remote, names["mesh"])
  again.local_iterator.set_state(state)
  check(next(again), 3)
  again.close()
  print("global arrays exact; close() raised nothing", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
