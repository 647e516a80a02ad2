"""The Python API: `Server` starts real worker processes in-process, serves
the oracle's stream, and refuses what `elevator serve` refuses."""

from __future__ import annotations

import os
import socket
import time

import pytest

from grain_elevator.client import RemoteDataset, TransportOptions
from grain_elevator.server import BindError, ConfigError, Server, ServerOptions
from grain_elevator.server.process import supervisor
from helpers import assert_streams_equal
import datasets


@pytest.mark.parametrize("kind", ["bulk", pytest.param("grpc", marks=pytest.mark.slow)])
def test_a_server_started_from_python_serves_the_oracle_stream(config_path, kind):
  with Server(config_path, ServerOptions(port=0, workers=2)) as server:
    assert server.port and server.bulk_port and server.target == f"127.0.0.1:{server.port}"
    pids = server.worker_pids()
    assert len(pids) == 2
    with RemoteDataset(server.target, "aug2", 48, shard_index=1, shard_count=2,
                       transport=TransportOptions(kind=kind)) as remote:
      with RemoteDataset.embedded(config_path, "aug2", 48, shard_index=1,
                                  shard_count=2) as local:
        assert assert_streams_equal(remote, local) == 41
  deadline = time.monotonic() + 10
  while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(os.path.exists(f"/proc/{p}") for p in pids), "workers outlived the server"


def test_no_bulk_means_grpc_only(config_path):
  with Server(config_path, ServerOptions(port=0, workers=1, bulk=False)) as server:
    assert server.bulk_port is None
    with RemoteDataset(server.target, "plain", 64) as ds:
      it = iter(ds)
      next(it)
      assert not it._backend.uses_bulk  # pylint: disable=protected-access


@pytest.mark.parametrize("options,message", [
    (dict(tls_cert="cert.pem"), "--tls-cert and --tls-key go together"),
    (dict(tls_client_ca="ca.pem"), "--tls-client-ca needs --tls-cert and --tls-key"),
    (dict(tls_cert="c.pem", tls_key="k.pem", bulk=True),
     r"the bulk transport \(--bulk, --bulk-port\) serves plaintext and cannot be combined "
     "with TLS"),
    (dict(port=70000), r"port must be in \[0, 65536\), got 70000"),
    (dict(workers=0), "workers must be >= 1, got 0"),
    (dict(max_concurrent_requests=0), "max_concurrent_requests must be >= 1"),
])
def test_bad_options_are_refused_on_construction(options, message):
  with pytest.raises(ConfigError, match=message):
    ServerOptions(**options)


def test_tls_turns_the_bulk_transport_off_by_default():
  options = ServerOptions(tls_cert="c.pem", tls_key="k.pem")
  assert options.tls and not options.serves_bulk
  assert ServerOptions().serves_bulk and not ServerOptions(bulk=False).serves_bulk


def test_a_bad_config_or_a_taken_port_stops_start(tmp_path, config_path):
  with pytest.raises(ConfigError, match="does not exist"):
    Server(tmp_path / "none.toml", ServerOptions(port=0)).start()
  with socket.socket() as holder:  # no SO_REUSEPORT: nobody may share it
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    with pytest.raises(BindError, match=f"cannot bind 127.0.0.1:{port}"):
      Server(config_path, ServerOptions(port=port, workers=1)).start()


def test_the_ready_line_names_what_serves(config_path):
  with Server(config_path, ServerOptions(port=0, workers=1)) as server:
    line = supervisor.ready_line(server)
    assert line.startswith("elevator: serving [aug2, eval, forever, plain, raw, seed3, seed3fast]")
    assert supervisor.parse_ready_line(line) == (
        "127.0.0.1", server.port, server.bulk_port, server.health_port)


_PROBE = '''
import os
import numpy as np

def probe(ds):
  """Each record: the worker's $ELEVATOR_TEST_PROBE as the server reads it."""
  return ds.map(lambda _: {"probe": np.int64(os.environ.get("ELEVATOR_TEST_PROBE", "-1"))})
'''


@pytest.mark.parametrize("value", ["7", "42"])
def test_a_worker_has_the_environment_its_server_started_with(
    tmp_path, data_dir, config_path, monkeypatch, value):
  """Workers are forked by a fork server started with an earlier environment
  (the first server's): each worker takes its own server's."""
  with Server(config_path, ServerOptions(port=0, workers=1)):
    pass  # the fork server runs, without the variable
  (tmp_path / "env_probe.py").write_text(_PROBE)
  config = datasets.write_config(tmp_path / "elevator.toml",
                                 probe=datasets.dataset(data_dir / datasets.SHARDS,
                                                        pipeline="env_probe:probe"))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("ELEVATOR_TEST_PROBE", value)
  with Server(str(config), ServerOptions(port=0, workers=2)) as server:
    with RemoteDataset(server.target, "probe", 64) as ds:
      for _, batch in zip(range(4), ds):
        assert set(batch["probe"].tolist()) == {int(value)}
