"""Which JPEG decoder the image pipelines use, by measurement.

Decoding is most of an image pipeline's CPU, so pipelines/images.py's choice is
made here: every installed candidate decodes the same ImageNet-sized
synthetic JPEGs (pipelines/images.py's, as `elevator bench --workloads image`
uses) to RGB uint8 on one thread, in interleaved rounds, and its pixels are
compared with simplejpeg's. The rest of the training step (crop, resize,
flip) is timed beside it, for scale.

    python -m grain_elevator.tools.bench.decoders [--images 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from grain_elevator.pipelines import images

Decoder = Callable[[bytes], np.ndarray]


def candidates() -> tuple[dict[str, Decoder], dict[str, str], dict[str, str]]:
  """(name -> decode, name -> version, name -> why unavailable)."""
  found: dict[str, Decoder] = {}
  versions: dict[str, str] = {}
  missing: dict[str, str] = {}
  try:
    import simplejpeg  # pylint: disable=g-import-not-at-top
    found["simplejpeg"] = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")
    versions["simplejpeg"] = simplejpeg.__version__
  except ImportError as e:
    missing["simplejpeg"] = str(e)
  try:
    import cv2  # pylint: disable=g-import-not-at-top
    cv2.setNumThreads(1)
    found["OpenCV imdecode"] = lambda b: cv2.imdecode(np.frombuffer(b, np.uint8),
                                                      cv2.IMREAD_COLOR_RGB)
    versions["OpenCV imdecode"] = cv2.__version__
  except ImportError as e:
    missing["OpenCV imdecode"] = str(e)
  try:
    import PIL  # pylint: disable=g-import-not-at-top
    from PIL import Image  # pylint: disable=g-import-not-at-top
    found["Pillow"] = lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
    versions["Pillow"] = PIL.__version__
  except ImportError as e:
    missing["Pillow"] = str(e)
  try:
    import turbojpeg  # pylint: disable=g-import-not-at-top
    tj = turbojpeg.TurboJPEG()
    found["PyTurboJPEG"] = lambda b: tj.decode(b, pixel_format=turbojpeg.TJPF_RGB)
    versions["PyTurboJPEG"] = getattr(turbojpeg, "__version__", "?")
  except (ImportError, RuntimeError, OSError) as e:
    missing["PyTurboJPEG"] = f"{type(e).__name__}: {e}"
  return found, versions, missing


def _per_image_us(fn: Callable[[bytes], Any], data: list[bytes]) -> float:
  t = time.perf_counter()
  for b in data:
    fn(b)
  return (time.perf_counter() - t) / len(data) * 1e6


def run(num_images: int, rounds: int) -> dict[str, Any]:
  jpegs = [bytes(images.decode_image_record(images.synthetic_record(i, classes=10, seed=0))[1])
           for i in range(num_images)]
  found, versions, missing = candidates()
  reference = [found["simplejpeg"](b) for b in jpegs[:20]] if "simplejpeg" in found else None
  rng = np.random.default_rng(0)
  decoded = [images.decode_image(b) for b in jpegs]

  def augment(image: np.ndarray) -> Any:  # train_pipeline's step after decoding
    return images._crop_resize_flip(  # pylint: disable=protected-access
        {"image": image, "label": 0}, rng, size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
        attempts=10, flip=True)

  times: dict[str, list[float]] = {name: [] for name in found}
  times["(crop, resize 224, flip)"] = []
  for _ in range(rounds):
    for name, fn in found.items():
      times[name].append(_per_image_us(fn, jpegs))
    times["(crop, resize 224, flip)"].append(_per_image_us(augment, decoded))
  rows = {}
  for name, ts in times.items():
    row: dict[str, Any] = {"us_per_image": statistics.median(ts), "rounds_us": ts}
    if name in found and reference is not None:
      diff = max(int(np.abs(found[name](b).astype(np.int16) - r).max())
                 for b, r in zip(jpegs, reference))
      row["max_abs_diff_vs_simplejpeg"] = diff
    rows[name] = row
  return {"images": num_images, "rounds": rounds,
          "mean_jpeg_bytes": sum(map(len, jpegs)) / len(jpegs),
          "rows": rows, "versions": versions, "missing": missing}


def table(report: dict[str, Any]) -> str:
  decoders = {k: v for k, v in report["rows"].items() if not k.startswith("(")}
  fastest = min(r["us_per_image"] for r in decoders.values())
  lines = [f"{report['images']} JPEGs (~{report['mean_jpeg_bytes'] / 1000:.0f} KB, ~500x375), "
           f"one thread, median of {report['rounds']} interleaved rounds", "",
           "| decoder | version | µs / image | images/s per core | × fastest | max pixel "
           "difference from simplejpeg |", "|---|---|---|---|---|---|"]
  for name, r in report["rows"].items():
    us = r["us_per_image"]
    ratio = f"{us / fastest:.2f}" if name in decoders else "—"
    lines.append(f"| {name} | {report['versions'].get(name, '')} | {us:,.0f} | "
                 f"{1e6 / us:,.0f} | {ratio} | {r.get('max_abs_diff_vs_simplejpeg', '—')} |")
  lines += [f"| {name} | not available: {why[:80]} | | | | |"
            for name, why in report["missing"].items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m grain_elevator.tools.bench.decoders",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=200)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--json", default=None, help="also write the results here")
  a = p.parse_args(argv)
  report = run(a.images, a.rounds)
  print(table(report))
  if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
