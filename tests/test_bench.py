"""`elevator bench` and `bench-feed` run end to end (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess

from grain_elevator.tools.launcher import ELEVATOR


def test_bench_reports_every_system(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--workloads", "small,large", "--small-records", "3000",
       "--large-records", "200", "--workers", "1", "--repeats", "1", "--seconds", "0.3",
       "--warmup", "0.1", "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  for workload in ("small", "large"):
    systems = report["workloads"][workload]["systems"]
    assert set(systems) == {"grain_t0_mp0", "grain_t0_mp2", "grain_t16_mp0", "grain_t16_mp2",
                            "embedded", "service_w1", "service_w1_grpc", "service_w1_zstd",
                            "service_w1_per_record", "service_w1_arrayrecord", "tcp",
                            "floor"}
    for key, row in systems.items():
      assert row["records_per_s"]["median"] > 0, key
    assert systems["service_w1"]["resume_first_batch_s"]["median"] > 0
  assert "| (c) grain-elevator service, W=1 |" in result.stdout
  assert "tf.data service: skipped" in result.stdout
  assert "| (f) floor: shard reads + TCP, W=1, raw records |" in result.stdout
  assert "| (c) service, W=1, shards read through ArrayRecord |" in result.stdout


def test_bench_feed_reports_stall_and_h2d(tmp_path):
  result = subprocess.run(
      [*ELEVATOR, "bench-feed", "--steps", "10", "--step-ms", "1", "--records", "3000",
       "--workers", "1", "--data", str(tmp_path / "data")],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "| 1 | grain-elevator service + to_device |" in result.stdout
  assert "| 1 | local Grain + device_put recipe |" in result.stdout
