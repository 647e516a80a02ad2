"""Encoded images (JPEG, PNG, ...) as records, and their training pipelines.

A record is ``label: int64 little-endian (8 bytes) | the image file's bytes``,
the file unchanged; `elevator convert images` writes it. The pipelines are
what a config's ``pipeline = "..."`` names:

    [datasets.imagenet]
    paths = ["imagenet/train-*.array_record"]
    pipeline = "grain_elevator.pipelines.images:train_pipeline"
    [datasets.imagenet.options]
    size = 224

`train_pipeline` decodes, takes an Inception-style random resized crop,
resizes it to size x size and flips half the images: {"image":
uint8[size, size, 3], "label": int64}. Its randomness comes from Grain's
per-index generator (`random_map`), so a record's output is a pure function
of (record bytes, seed, stream position) and the service gives exactly what
embedded mode gives.

Decoding is simplejpeg for JPEG (libjpeg-turbo, accurate integer DCT, strict:
a file libjpeg only warns about is refused) and OpenCV for other formats and
for the resize (`INTER_LINEAR_EXACT`, OpenCV's bit-exact bilinear). Both are
the optional extra ``grain-elevator[images]``. Why these: BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from typing import Any, Callable, Sequence

import numpy as np

from grain_elevator.pipelines import DataLossError

_LABEL = struct.Struct("<q")
LABEL_BYTES = _LABEL.size
_JPEG_SOI = b"\xff\xd8"
_INSTALL = "pip install 'grain-elevator[images]'"


# --- the record format ------------------------------------------------------

def encode_image_record(label: int, data: bytes) -> bytes:
  """Returns the record for an image file's bytes `data` with class `label`."""
  return _LABEL.pack(label) + bytes(data)


def decode_image_record(raw: bytes) -> tuple[int, memoryview]:
  """Returns (label, the image file's bytes) of a record, without copying.

  Raises ValueError if the record is too short to hold its label.
  """
  if len(raw) < LABEL_BYTES:
    raise ValueError(f"an image record is {len(raw)} bytes, shorter than its "
                     f"{LABEL_BYTES}-byte label: not in the image record format")
  view = memoryview(raw)
  return _LABEL.unpack_from(view)[0], view[LABEL_BYTES:]


# --- decoding ---------------------------------------------------------------

@functools.cache
def _codecs() -> tuple[Any, Any]:
  try:
    import cv2  # pylint: disable=g-import-not-at-top
    import simplejpeg  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"image pipelines need simplejpeg and OpenCV: {_INSTALL} ({e})") from e
  return cv2, simplejpeg


def versions() -> dict[str, str]:
  """The decoder and resizer versions; a record's pixels are a pure function
  of its bytes for the same versions (record them with your results)."""
  cv2, simplejpeg = _codecs()
  return {"simplejpeg": simplejpeg.__version__, "opencv": cv2.__version__}


def decode_image(data: bytes | memoryview, *, strict: bool = True) -> np.ndarray:
  """An image file's bytes -> uint8[height, width, 3] RGB.

  JPEG through simplejpeg (grayscale and CMYK converted to RGB; `strict`
  refuses files libjpeg can only partly read); anything else OpenCV reads
  (PNG, BMP, WebP, TIFF, ...) through OpenCV, alpha dropped, EXIF orientation
  ignored (as TensorFlow and Pillow do). Raises ValueError if it cannot.
  """
  cv2, simplejpeg = _codecs()
  if bytes(data[:2]) == _JPEG_SOI:
    return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=strict)
  image = cv2.imdecode(np.frombuffer(data, np.uint8),
                       cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
  if image is None:
    raise ValueError("not an image OpenCV can read")
  return image


def _decode(index: int, raw: bytes, *, strict: bool) -> dict[str, Any]:
  """Record -> {"image": uint8[h, w, 3], "label": int64}; `index` names it in errors."""
  try:
    label, data = decode_image_record(raw)
    image = decode_image(data, strict=strict)
  except ImportError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    head = bytes(raw[LABEL_BYTES:LABEL_BYTES + 4]).hex(" ")
    raise DataLossError(
        f"the record at stream position {index} ({len(raw):,} bytes, image bytes "
        f"starting {head or '(none)'}) is not a readable image: "
        f"{type(e).__name__}: {e}") from e
  return {"image": image, "label": np.int64(label)}


# --- the crop ---------------------------------------------------------------

def random_resized_crop_box(height: int, width: int, rng: np.random.Generator, *,
                            scale: Sequence[float] = (0.08, 1.0),
                            ratio: Sequence[float] = (3 / 4, 4 / 3),
                            attempts: int = 10) -> tuple[int, int, int, int]:
  """(top, left, crop_height, crop_width) of an Inception-style random crop.

  Up to `attempts` draws of an area fraction uniform in `scale` and an aspect
  ratio (width/height) log-uniform in `ratio`; the first box that fits is
  placed uniformly at random. If none fits, the largest centred box whose
  aspect ratio is within `ratio`. Always 1 <= crop <= image on each axis.
  """
  if height < 1 or width < 1:
    raise ValueError(f"an image of {height}x{width} pixels has nothing to crop")
  area = height * width
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for _ in range(attempts):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_lo, log_hi))
    w = round(math.sqrt(target * aspect))
    h = round(math.sqrt(target / aspect))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  aspect = width / height
  if aspect < ratio[0]:  # too tall: full width, height cut to the ratio
    w, h = width, min(height, max(1, round(width / ratio[0])))
  elif aspect > ratio[1]:  # too wide
    w, h = min(width, max(1, round(height * ratio[1]))), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  cv2, _ = _codecs()
  if image.shape[:2] == (height, width):
    return np.ascontiguousarray(image)
  return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR_EXACT)


def _crop_resize_flip(record: dict[str, Any], rng: np.random.Generator, *, size: int,
                      scale: Sequence[float], ratio: Sequence[float], attempts: int,
                      flip: bool) -> dict[str, Any]:
  image = record["image"]
  top, left, h, w = random_resized_crop_box(image.shape[0], image.shape[1], rng, scale=scale,
                                            ratio=ratio, attempts=attempts)
  out = _resize(image[top:top + h, left:left + w], size, size)
  if flip and rng.random() < 0.5:
    out = np.ascontiguousarray(out[:, ::-1])
  return {"image": out, "label": record["label"]}


def _center(record: dict[str, Any], *, size: int, resize: int) -> dict[str, Any]:
  image = record["image"]
  h, w = image.shape[:2]
  if h <= w:
    rh, rw = resize, max(resize, round(w * resize / h))
  else:
    rh, rw = max(resize, round(h * resize / w)), resize
  image = _resize(image, rh, rw)
  top, left = (rh - size) // 2, (rw - size) // 2
  return {"image": np.ascontiguousarray(image[top:top + size, left:left + size]),
          "label": record["label"]}


# --- the pipelines ----------------------------------------------------------

def _check_size(size: int) -> None:
  if not isinstance(size, int) or size < 1:
    raise ValueError(f"size must be a positive integer, got {size!r}")


def train_pipeline(ds: Any, *, size: int = 224, scale: Sequence[float] = (0.08, 1.0),
                   ratio: Sequence[float] = (3 / 4, 4 / 3), attempts: int = 10,
                   flip: bool = True, strict: bool = True) -> Any:
  """Pipeline: image records -> {"image": uint8[size, size, 3], "label": int64}.

  Decode (RGB always), an Inception-style random resized crop
  (`random_resized_crop_box`), a bilinear resize to size x size and, with
  `flip`, a horizontal flip of half the images. Randomness from Grain's
  per-index generator: the same seed and position give the same bytes.
  A record that is not a readable image raises DataLossError naming its
  stream position (the server sends it as DATA_LOSS).
  """
  _check_size(size)
  if not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
    raise ValueError(f"need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], "
                     f"got scale={list(scale)}, ratio={list(ratio)}")
  _codecs()  # a missing extra fails here, at start-up
  ds = ds.map_with_index(functools.partial(_decode, strict=strict))
  return ds.random_map(functools.partial(
      _crop_resize_flip, size=size, scale=tuple(scale), ratio=tuple(ratio),
      attempts=int(attempts), flip=bool(flip)))


def eval_pipeline(ds: Any, *, size: int = 224, crop_fraction: float = 0.875,
                  strict: bool = True) -> Any:
  """Pipeline: image records -> {"image": uint8[size, size, 3], "label": int64}.

  Decode, resize the shorter side to round(size / crop_fraction) (256 for
  224), then take the centred size x size crop. No randomness.
  """
  _check_size(size)
  if not 0 < crop_fraction <= 1:
    raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}")
  _codecs()
  ds = ds.map_with_index(functools.partial(_decode, strict=strict))
  return ds.map(functools.partial(_center, size=size, resize=round(size / crop_fraction)))


# --- synthetic data ---------------------------------------------------------

def synthetic_jpeg(rng: np.random.Generator, *, height: int = 375, width: int = 500,
                   quality: int = 90) -> bytes:
  """A JPEG of ImageNet's typical size and weight (~110 KB for 500x375 at
  quality 90, 4:2:0): smooth random content at four scales plus a little
  fine noise, so it compresses like a photo, not like noise."""
  cv2, simplejpeg = _codecs()
  image = np.zeros((height, width, 3), np.int16)
  for (cw, ch), amp in (((4, 3), 60), ((16, 12), 48), ((64, 48), 48),
                        ((width // 2, height // 2), 64)):
    small = rng.integers(0, 256, size=(ch, cw, 3), dtype=np.uint8)
    up = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC).astype(np.int16)
    image += (up - 128) * amp // 128
  image += rng.integers(-10, 11, size=image.shape, dtype=np.int16)
  image += rng.integers(60, 190, size=3, dtype=np.int16)
  pixels = np.clip(image, 0, 255).astype(np.uint8)
  return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB",
                                colorsubsampling="420")


def synthetic_size(rng: np.random.Generator) -> tuple[int, int]:
  """(height, width) near ImageNet's typical 375x500; one in five portrait."""
  h, w = 375 + int(rng.integers(-30, 31)), 500 + int(rng.integers(-40, 41))
  return (w, h) if rng.random() < 0.2 else (h, w)


def synthetic_record(i: int, *, classes: int, seed: int) -> bytes:
  """Record i of a synthetic image dataset (label i % classes): the same
  bytes for the same (i, classes, seed), in any order of calls."""
  rng = np.random.default_rng([seed, i])
  h, w = synthetic_size(rng)
  return encode_image_record(i % classes, synthetic_jpeg(rng, height=h, width=w))


def write_synthetic_jpegs(out_dir: str, n: int, classes: int = 10, seed: int = 0,
                          progress: Callable[[int, int], None] | None = None) -> list[str]:
  """Writes n synthetic JPEGs in a class-per-subfolder layout,
  ``OUT_DIR/class_CCC/img_IIIIII.jpg`` (image i in class i % classes, the
  same bytes as `synthetic_record(i)` holds); returns their paths."""
  paths = []
  for i in range(n):
    label, data = decode_image_record(synthetic_record(i, classes=classes, seed=seed))
    folder = os.path.join(out_dir, f"class_{label:03d}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"img_{i:06d}.jpg")
    with open(path, "wb") as f:
      f.write(data)
    paths.append(path)
    if progress and (i + 1) % 100 == 0:
      progress(i + 1, n)
  return paths
