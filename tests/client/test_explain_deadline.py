"""Explain and summaries stop with their client (issue 44, finding 8).

Tracing a stream's global batch makes it twice; before, a stream Explain at
G = H = 2**17 with a 2 s deadline went on for at least 12.5 s more. Now the
traced pipeline checks the request before each element, as the served one
does, so work stops within one element of the deadline, and a G over
MAX_STREAM_SUMMARY_ROWS is refused, naming it, before anything is made.

The dataset's elements are slow (2 ms) only when traced (their tokens are
codes), so the traced batch takes ~33 s whatever the machine: what would
run past the deadline is exactly what the fix must stop."""

from __future__ import annotations

import pathlib
import sys
import textwrap
import time

import grpc
import pytest

from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import elevator_pb2_grpc as pb_grpc
from grain_elevator.proto import limits
from grain_elevator.server import Server, ServerOptions
from grain_elevator.tools import top
import datasets
from helpers import wait_for

G = limits.MAX_STREAM_SUMMARY_ROWS  # the most one trace may make: 2**14 elements
DEADLINE_S = 1.0
# Work stopping after the deadline: within one 2 ms element, plus the time to
# see it on a scrape. Measured on a 2-core machine shared with other tests:
# 0.004 s after the client's DEADLINE_EXCEEDED; before the fix the trace
# went on past this bound (the traced batch takes ~33 s). The bound only
# ends a hang.
STOPPED_WITHIN_S = 10.0

SLOW_TRACE = textwrap.dedent("""\
    import time
    import numpy as np
    from grain_elevator.pipelines import examples

    def tokens(ds):
      return examples.decode_images(ds, height=4, width=4, channels=3).map(_tokens)

    def _tokens(e):
      return {"tokens": e["image"].reshape(-1)[:8].astype(np.int32)}

    def slow_when_traced(ds):
      return ds.map(_slow)

    def _slow(e):
      if int(np.max(e["tokens"])) >= 1 << 32:  # codes: the traced pipeline
        time.sleep(0.002)
      return e
    """)


@pytest.fixture(scope="module")
def slow_server(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
  root = tmp_path_factory.mktemp("slow-trace")
  (root / "slow_trace.py").write_text(SLOW_TRACE)
  config = datasets.write_config(
      root / "elevator.toml",
      slow=datasets.dataset(data_dir / "shards" / "*.array_record",
                            pipeline="slow_trace:tokens",
                            iter_pipeline="slow_trace:slow_when_traced", num_epochs=0))
  sys.path.insert(0, str(root))  # for the workers the fork server starts
  try:
    with Server(config, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
      yield server
  finally:
    sys.path.remove(str(root))


def _inflight(server) -> float:
  scraped = top.scrape(f"127.0.0.1:{server.metrics_port}", timeout_s=60)
  return scraped[("elevator_inflight_requests", ())]


def _explain(g: int, summary: bool) -> pb.ExplainRequest:
  """One step of G: a summary's whole, or an explanation of its last row
  (G hosts of one row each: the slice is small, the traced batch is not)."""
  return pb.ExplainRequest(summary=summary, request=pb.BatchRequest(
      dataset="slow", global_batch_size=g, shard_index=0 if summary else g - 1,
      shard_count=1 if summary else g, num_steps=1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("summary", [False, True], ids=["explain", "summary"])
def test_tracing_stops_within_an_element_of_the_deadline(slow_server, summary):
  with grpc.insecure_channel(slow_server.target) as channel:
    stub = pb_grpc.ElevatorStub(channel)
    with pytest.raises(grpc.RpcError) as info:
      stub.Explain(_explain(G, summary), timeout=DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    began = time.monotonic()
    wait_for(lambda: _inflight(slow_server) == 0, "the Explain to stop", STOPPED_WITHIN_S)
    print(f"stopped {time.monotonic() - began:.3f} s after the deadline")
    # The worker serves the next request at once: a refusal needs no slot's wait.
    with pytest.raises(grpc.RpcError) as info:
      stub.Explain(_explain(2 * G, summary), timeout=60)
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert (f"of at most {G} rows (MAX_STREAM_SUMMARY_ROWS); G={2 * G} is more"
          in info.value.details())


# A mixture summary is arithmetic, counted a chunk of positions at a time;
# MAX_SUMMARY_ROWS of it (2**28 rows) took 12 s past a 3 s deadline before.
MIX_G = 1 << 12
MIX_STEPS = limits.MAX_SUMMARY_ROWS // MIX_G


@pytest.fixture(scope="module")
def mixture_server(data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
  shards = data_dir / "shards" / "*.array_record"
  config = datasets.write_config(
      tmp_path_factory.mktemp("mix-summary") / "elevator.toml",
      a=datasets.raw(shards, seed=1), b=datasets.raw(shards, seed=2),
      mix=datasets.mixture(a=0.7, b=0.3))
  with Server(config, ServerOptions(port=0, workers=1, metrics_port=0)) as server:
    yield server


@pytest.mark.timeout(300)
def test_a_mixture_summary_stops_within_a_chunk_of_the_deadline(mixture_server):
  request = pb.ExplainRequest(summary=True, request=pb.BatchRequest(
      dataset="mix", global_batch_size=MIX_G, shard_index=0, shard_count=1,
      num_steps=MIX_STEPS))
  with grpc.insecure_channel(mixture_server.target) as channel:
    with pytest.raises(grpc.RpcError) as info:
      pb_grpc.ElevatorStub(channel).Explain(request, timeout=DEADLINE_S)
  assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
  began = time.monotonic()
  wait_for(lambda: _inflight(mixture_server) == 0, "the summary to stop", STOPPED_WITHIN_S)
  print(f"stopped {time.monotonic() - began:.3f} s after the deadline")
