"""The client-settings A/B measures the default, a sweep of tuned settings and
plain TCP in one run, at each server size, with the real pipeline and the
sleeping one, and names the best of the sweep."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grain_elevator.tools.bench import clients
from grain_elevator.tools.bench import workloads


@pytest.mark.parametrize("name", clients.WORKLOADS)
@pytest.mark.parametrize("workers", [2, 8, 16])
def test_the_sweep_keeps_every_connection_busy(name, workers):
  step_bytes = (0 if name == "text" else workloads.WORKLOADS[name].global_batch_size
                * workloads.WORKLOADS[name].delivered_bytes_per_record)
  swept = clients.sweep(name, workers, step_bytes)
  assert all(label.startswith(clients.TUNED) for label in swept)
  bench = [label for label in swept if "(elevator bench's)" in label]
  assert len(bench) == (1 if name in ("small", "large", "image") else 0), list(swept)
  steps = {c["transport"]["steps_per_request"] for c in swept.values()}
  for client in swept.values():
    transport = client["transport"]
    if name == "text":  # a stream: one request at a time
      assert "connections_per_target" not in transport
      assert client["prefetch"] >= transport["steps_per_request"]
      continue
    conns = transport["connections_per_target"]
    assert conns <= clients.MAX_SWEEP_CONNECTIONS
    # A request in flight on every connection (one replica).
    assert client["prefetch"] >= conns * transport["steps_per_request"], client
  if name != "text":
    assert {1, max(clients.sweep_steps(step_bytes))} <= steps
    assert {c["transport"]["connections_per_target"] for c in swept.values()
            if c["transport"]["steps_per_request"] == 1} == {
                min(clients.MAX_SWEEP_CONNECTIONS, m * workers)
                for m in clients.SWEEP_CONNECTIONS_PER_WORKER}


@pytest.mark.slow
def test_the_default_the_sweep_and_the_wire_are_measured(tmp_path):
  """The costly workload at tiny sizes: its CPU-bound pipeline on 1 real
  worker, its sleeping one on 2."""
  out = tmp_path / "clients.json"
  result = subprocess.run(
      [sys.executable, "-m", "grain_elevator.tools.bench.clients", "--data", str(tmp_path),
       "--workloads", "costly", "--records", "256", "--rounds", "1", "--seconds", "0.2",
       "--warmup", "0.1", "--workers", "1", "--sleeping-workers", "2",
       "--sleep-us-per-record", "500", "--sweep-connections", "1,2", "--sweep-steps", "1",
       "--json", str(out),
       "--explore", '{"wide": {"prefetch": 8, "transport": {"steps_per_request": 1}}}'],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())["costly"]
  assert list(report) == ["W=1", "W=2 sleeping"]
  assert report["W=1"]["pipeline"] == "real"
  assert report["W=2 sleeping"]["pipeline"] == "sleeping 500 µs/record"
  for key, block in report.items():
    rows = block["rows"]
    w = block["workers"]
    tuned = [f"{clients.TUNED}: {c} conns, 1 steps/request, {2 * c} ahead" for c in (w, 2 * w)]
    assert list(rows) == ["default", "wide", *tuned, "plain TCP"], key
    for label, row in rows.items():
      assert row["median"] == row["runs"][0] > 0, (key, label)
      # (0 where 0.2 s of a few 64 KiB steps stay under the CPU clock's tick)
      assert row["client_cpu_s_per_gb"] >= 0, (key, label)
    # 64 records of 1,024 B a step, as the trainer receives them.
    step_bytes = rows["default"]["median"] * 1e9 / (rows["default"]["records_per_s"] / 64)
    assert step_bytes == pytest.approx(64 << 10)
    assert rows["default"]["window"][0] > 0  # the client's stats: steps in flight
    assert rows["plain TCP"]["window"] == [None]
    # The best of the sweep, never an --explore row.
    assert block["best"] == max(tuned, key=lambda k: rows[k]["median"]), key
    ratio = rows["default"]["median"] / rows[block["best"]]["median"]
    line = next(l for l in result.stdout.splitlines()
                if l.startswith(f"| costly | {w}, ") and "tuned best: " in l)
    assert f"| tuned best: {block['best'].split(': ', 1)[1]} |" in line
    assert f"| **{ratio:.2f}** |" in line
  assert "costly: default × best tuned W=1 " in result.stdout
  assert f"(goal ≥ {clients.GOAL} at every W: " in result.stdout
