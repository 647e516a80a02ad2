"""`elevator bench` and `bench-feed` run end to end on tiny sizes. No timing
is asserted; what is checked is that every figure measures what its row
says: the bytes each system delivered, rates that agree with each other,
and ratios that are the printed figures' ratios.

The bench runs at G=8 (--global-batch-size) rather than each workload's
own: local Grain's read threads compute 32 steps ahead, at every setting
and in every mp_prefetch process, so a full-size step multiplies what a
run computes and never reads; a small one checks every system the same."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

import pytest

from grain_elevator.tools.bench import workloads
from grain_elevator.tools.testing.launcher import ELEVATOR

pytestmark = pytest.mark.slow

SYSTEMS = {"grain_t0_mp0", "grain_t0_mp2", "grain_t16_mp0", "grain_t16_mp2", "embedded",
           "service_w1", "service_w1_default", "service_w1_grpc", "service_w1_zstd", "service_w1_per_record",
           "service_w1_arrayrecord", "tcp", "floor"}
# The default client's batches as torch tensors, where the torch extra is installed.
HAS_TORCH = importlib.util.find_spec("torch") is not None
if HAS_TORCH:
  SYSTEMS.add("service_w1_torch")


def _cell(table: str, label: str, column: int) -> str:
  row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
  return row.split(" | ")[column].strip()


G = 8  # rows a step in the bench runs below (--global-batch-size)


def test_bench_reports_every_system(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--workloads", "large", "--large-records", "200", "--workers", "1",
       "--repeats", "1", "--seconds", "0.3", "--warmup", "0.1", "--global-batch-size", str(G),
       "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  # One workload end to end (each costs ~50 s of process starts here); the
  # small one's data and config are checked below, its decode everywhere else.
  for name in ("large",):
    w = workloads.WORKLOADS[name]
    assert report["workloads"][name]["global_batch_size"] == G != w.global_batch_size
    systems = report["workloads"][name]["systems"]
    assert set(systems) == SYSTEMS
    for key, row in systems.items():
      (run,) = row["runs"]  # --repeats 1
      # The floor moves raw records; everything else the decoded batch.
      per_record = w.record_bytes if key == "floor" else w.delivered_bytes_per_record
      assert run["batch_bytes"] == G * per_record, key
      assert run["records_per_s"] > 0, key
      # GB/s is records/s times the bytes of a record, in the same run.
      assert run["gb_per_s"] == pytest.approx(run["records_per_s"] * per_record / 1e9,
                                              rel=1e-6), key
      assert row["records_per_s"]["median"] == run["records_per_s"], key
    for key in ("embedded", "service_w1", "grain_t0_mp0"):
      assert systems[key]["resume_first_batch_s"]["median"] > 0, key
    for key in ("grain_t0_mp2", "tcp", "floor"):  # no single cursor, or no iterator
      assert systems[key]["resume_first_batch_s"] is None, key
    # The table's ratios are the ratios of its own medians.
    best = max(r["records_per_s"]["median"] for k, r in systems.items()
               if k.startswith("grain_"))
    service = systems["service_w1"]
    table = result.stdout.split(f"### {name}:")[1]
    label = service["label"]
    assert float(_cell(table, label, 3)) == pytest.approx(
        service["records_per_s"]["median"] / best, abs=0.006)
    assert float(_cell(table, label, 4)) == pytest.approx(
        service["gb_per_s"]["median"] / systems["tcp"]["gb_per_s"]["median"], abs=0.006)
  assert "| (c) grain-elevator service, W=1 |" in result.stdout
  assert "tf.data service: skipped" in result.stdout
  assert "| (f) floor: shard reads + TCP, W=1, raw records |" in result.stdout
  assert "| (c) service, W=1, shards read through ArrayRecord |" in result.stdout
  assert f"### large: 153,616 B records, G={G}, 200 records;" in result.stdout
  if HAS_TORCH:  # the note's ratio is the table's two CPU-per-GB medians
    systems = report["workloads"]["large"]["systems"]
    ratio = (systems["service_w1_torch"]["client_cpu_s_per_gb"]["median"]
             / systems["service_w1_default"]["client_cpu_s_per_gb"]["median"])
    assert f"cost the trainer {ratio:.2f}x the CPU per GB of its numpy batches" in result.stdout


def test_every_workload_prepares_a_config_that_loads(tmp_path):
  from grain_elevator.server import load_config  # pylint: disable=g-import-not-at-top
  for name in ("small", "large"):
    w = workloads.WORKLOADS[name]
    config = load_config(workloads.prepare(tmp_path, w, 40))
    assert set(config.datasets) >= {name}, name
    assert len(workloads.shard_files(tmp_path, w)) == 8, name


def test_bench_feed_reports_stall_and_h2d(tmp_path):
  out = tmp_path / "feed.json"
  result = subprocess.run(
      [*ELEVATOR, "bench-feed", "--steps", "10", "--step-ms", "1", "--records", "3000",
       "--workers", "1", "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  (run,) = json.loads(out.read_text())
  for system in ("local Grain + device_put recipe", "grain-elevator service + to_device"):
    m = run["systems"][system]
    assert 0 <= m["stall_fraction"] <= 1 and m["steps_per_s"] > 0 and m["h2d_gb_per_s"] > 0
    stall = re.search(rf"\| 1 \| {re.escape(system)} \| ([\d.]+)% \|", result.stdout)
    assert stall and float(stall.group(1)) == pytest.approx(100 * m["stall_fraction"], abs=0.06)


def test_bench_feed_device_checks_exactness_and_says_when_there_is_no_gpu(tmp_path):
  """The GPU check runs anywhere: without a GPU it says so, leaves out the
  GPU rows and still compares both paths with embedded mode."""
  out = tmp_path / "device.json"
  result = subprocess.run(
      [*ELEVATOR, "bench-feed", "--device", "--steps", "20", "--records", "100",
       "--workers", "1", "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["exact"] == {"to_device": True, **({"TorchLoader": True} if HAS_TORCH else {})}
  assert report["host_steps_per_s"] > 0
  if report["gpu"] is None:
    assert "no GPU present" in result.stdout and "| to_device" not in result.stdout
    assert "to_device" not in report and "jax_limit" not in report
  else:  # a GPU machine: its rows are there, each against its limit
    assert report["to_device"]["transfer_s"] > 0 and "page_locked_s" in report["jax_limit"]
    assert "× page-locked copy" in result.stdout


IMAGE_SYSTEMS = {"grain_t0_mp0", "grain_t0_mp2", "grain_t16_mp0", "grain_t16_mp2",
                 "service_default", "service_w1"}


def test_bench_image_workload_reports_per_image_costs(tmp_path):
  pytest.importorskip("cv2")
  pytest.importorskip("simplejpeg")
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [*ELEVATOR, "bench", "--workloads", "image", "--image-records", "96", "--workers", "1",
       "--repeats", "1", "--seconds", "0.3", "--warmup", "0.1", "--no-tfdata",
       "--global-batch-size", str(G), "--data", str(tmp_path / "data"), "--json", str(out)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  wl = json.loads(out.read_text())["workloads"]["image"]
  w = workloads.WORKLOADS["image"]
  assert wl["kind"] == "image" and wl["records"] == 96
  assert wl["global_batch_size"] == G != w.global_batch_size
  systems = wl["systems"]
  assert set(systems) == IMAGE_SYSTEMS
  for key, row in systems.items():
    (run,) = row["runs"]
    # Every system delivers G decoded 224x224x3 uint8 images and their labels.
    assert run["batch_bytes"] == G * (8 + 224 * 224 * 3), key
    rate = run["records_per_s"]
    assert rate > 0, key
    assert run["client_cpu_s_per_1k"] == pytest.approx(run["client_cores"] / rate * 1000), key
    if key.startswith("service"):  # the server's processes were measured, and worked
      assert run["server_cores"] > 0.1, key
      assert run["images_per_core_s"] == pytest.approx(rate / run["server_cores"]), key
      assert run["server_cpu_s_per_1k"] == pytest.approx(run["server_cores"] / rate * 1000)
    else:  # local Grain: the trainer's own cores do the work
      assert "server_cores" not in run, key
      assert run["images_per_core_s"] == pytest.approx(rate / run["client_cores"]), key
  assert "### image: JPEG records" in result.stdout
  assert "| (c) service, W=1, bench client settings |" in result.stdout
  assert "(goal ≤ 0.1:" in result.stdout and "(goal ≥ 1:" in result.stdout
  assert "tf.data service: skipped" in result.stdout
