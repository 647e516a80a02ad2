"""The converter benchmark converts each input and reports it against the disk."""

from __future__ import annotations

import json

import pytest

from grain_elevator.tools.bench import convert

pytestmark = pytest.mark.slow  # converts every input at two worker counts


def test_reports_every_input_and_worker_count(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert convert.main(["--data", str(tmp_path / "d"), "--workers", "1,2", "--scale", "0.002",
                       "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  rows = report["rows"]
  assert [(r["input"].split(",")[0], r["workers"]) for r in rows] == [
      ("TFRecord", 1), ("TFRecord", 2), ("TFRecord", 1), ("TFRecord", 2),
      ("images", 1), ("images", 2)]
  assert [r["records"] for r in rows] == [8, 8, 800, 800, 8, 8]
  for r in rows:
    assert r["mb_in"] > 0 and r["seconds"] > 0 and r["cpu_s"] > 0
    assert r["x_disk"] == r["mb_per_s"] / report["disk_direct_mb_per_s"]
  assert (tmp_path / "d" / "out" / "elevator.toml").exists()
  printed = capsys.readouterr().out
  assert printed.count("\n| ") == 1 + len(rows) and "× disk read" in printed
