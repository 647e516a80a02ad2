"""The decoder comparison decodes with every installed decoder and compares pixels."""

from __future__ import annotations

import json

import pytest

from grain_elevator.tools.bench import decoders

pytestmark = pytest.mark.slow  # encodes and decodes images with every decoder


def test_every_installed_decoder_is_measured_and_compared(tmp_path, capsys):
  pytest.importorskip("simplejpeg")
  out = tmp_path / "d.json"
  assert decoders.main(["--images", "4", "--rounds", "1", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  found, _, missing = decoders.candidates()
  assert set(report["rows"]) == {*found, "(crop, resize 224, flip)"}
  assert set(report["missing"]) == set(missing)
  # libjpeg-turbo's accurate integer DCT everywhere: the same pixels.
  assert report["rows"]["simplejpeg"]["max_abs_diff_vs_simplejpeg"] == 0
  if "OpenCV imdecode" in found:
    assert report["rows"]["OpenCV imdecode"]["max_abs_diff_vs_simplejpeg"] <= 2
  assert all(r["us_per_image"] > 0 for r in report["rows"].values())
  assert "| simplejpeg |" in capsys.readouterr().out
