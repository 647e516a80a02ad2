"""A plain `pip install .` (no extras) into a fresh virtualenv: no JAX, and
yet a server that serves and a client that reads numpy batches; device
feeding says which extra it needs.

The virtualenv is made without pip of its own, and this environment's pip
(the lock's) installs into it (`pip --python`): the same packages, less
the seconds ensurepip spends installing a pip nothing here runs. Nor does
it compile every module it installs (--no-compile): Python compiles those
the check imports as it imports them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    from grain_elevator.client import RemoteDataset, TransportOptions, to_device
    from grain_elevator.server import Server, ServerOptions

    if __name__ == "__main__":
      config = sys.argv[1]
      with Server(config, ServerOptions(port=0, workers=1)) as server:
        for kind in ("bulk", "grpc"):
          with RemoteDataset(server.target, "aug2", 40,
                             transport=TransportOptions(kind=kind)) as remote, \\
               RemoteDataset.embedded(config, "aug2", 40) as local:
            for k, (a, b) in enumerate(zip(remote, local, strict=True)):
              assert all(np.array_equal(a[key], b[key]) for key in b), (kind, k)
          print(f"{kind}: {k + 1} steps equal")
      try:
        to_device(RemoteDataset.embedded(config, "aug2", 40), None)
      except ImportError as e:
        print(f"to_device: {e}")
      print("jax loaded:", "jax" in sys.modules)
    """)


def test_a_plain_install_serves_and_reads_without_jax(tmp_path, config_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=120)
  py = str(venv / "bin" / "python")
  install = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--quiet",
                            "--no-compile", str(ROOT)],
                           capture_output=True, text=True, timeout=600)
  assert install.returncode == 0, install.stdout + install.stderr[-3000:]
  missing = subprocess.run([py, "-c", "import jax"], capture_output=True, text=True)
  assert missing.returncode != 0 and "No module named 'jax'" in missing.stderr
  (tmp_path / "check.py").write_text(CHECK)
  result = subprocess.run([py, str(tmp_path / "check.py"), config_path],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "bulk: 50 steps equal" in result.stdout and "grpc: 50 steps equal" in result.stdout
  assert ("to_device: feeding devices (grain_elevator.client.to_device) needs JAX: "
          "pip install 'grain-elevator[jax]'") in result.stdout
  assert "jax loaded: False" in result.stdout
  cli = subprocess.run([str(venv / "bin" / "elevator"), "describe", f"local:{config_path}",
                        "--dataset", "plain"], capture_output=True, text=True, timeout=120)
  assert cli.returncode == 0 and '"name": "plain"' in cli.stdout, cli.stderr
