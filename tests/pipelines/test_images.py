"""Encoded-image records and their pipelines (pipelines/images.py): the record
format, the crop's bounds, every input kind, corrupt files, and a real
server giving exactly embedded mode's batches."""

from __future__ import annotations

import pathlib

import grain
import numpy as np
import pytest

from grain_elevator.client import DataLossError, RemoteDataset
from grain_elevator.pipelines import examples
from grain_elevator.pipelines import images
import datasets
from helpers import assert_streams_equal

cv2 = pytest.importorskip("cv2")
simplejpeg = pytest.importorskip("simplejpeg")

NUM_RECORDS = 40
CORRUPT_AT = 5  # source index of the broken record in the "corrupt" dataset
PIPELINES = "grain_elevator.pipelines.images"
CONFIG = datasets.config_text(
    train=datasets.dataset("img/*.array_record", pipeline=f"{PIPELINES}:train_pipeline",
                           seed=3, num_epochs=2, options={"size": 224}),
    eval=datasets.dataset("img/*.array_record", pipeline=f"{PIPELINES}:eval_pipeline",
                          shuffle=False, options={"size": 96}),
    corrupt=datasets.dataset("bad/*.array_record", pipeline=f"{PIPELINES}:train_pipeline",
                             shuffle=False, options={"size": 32}),
)


def _jpeg(pixels: np.ndarray, **kw) -> bytes:
  colorspace = "GRAY" if pixels.shape[-1] == 1 else "RGB"
  return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=90,
                                colorspace=colorspace, **kw)


def _png(pixels: np.ndarray) -> bytes:
  """A PNG of RGB(A) or gray `pixels` (OpenCV writes BGR(A))."""
  if pixels.ndim == 3 and pixels.shape[-1] in (3, 4):
    order = [2, 1, 0, 3][:pixels.shape[-1]]
    pixels = pixels[..., order]
  ok, buf = cv2.imencode(".png", np.ascontiguousarray(pixels))
  assert ok
  return buf.tobytes()


def _pipeline(records: list[bytes], seed: int = 1, **options) -> grain.MapDataset:
  return images.train_pipeline(grain.MapDataset.source(records).seed(seed), **options)


def _smooth(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
  """Smooth pixels, which survive JPEG well enough to compare colours."""
  rng = np.random.default_rng(seed)
  small = rng.integers(0, 256, size=(2, 2, c), dtype=np.uint8)
  out = cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)
  return out.reshape(h, w, c)


# --- the record format --------------------------------------------------------

@pytest.mark.parametrize("label,data", [
    (0, b""), (7, b"\xff\xd8\xff"), (-1, b"x" * 1000), (2**62, bytes(range(256)))])
def test_record_round_trips(label, data):
  raw = images.encode_image_record(label, data)
  assert len(raw) == 8 + len(data)
  assert raw[:8] == label.to_bytes(8, "little", signed=True)
  got_label, got = images.decode_image_record(raw)
  assert (got_label, bytes(got)) == (label, data)


@pytest.mark.parametrize("raw", [b"", b"\x01" * 7])
def test_record_shorter_than_its_label_is_a_clear_error(raw):
  with pytest.raises(ValueError, match=f"image record is {len(raw)} bytes, shorter than"):
    images.decode_image_record(raw)


# --- the crop -----------------------------------------------------------------

@pytest.mark.parametrize("height,width", [
    (1, 1), (1, 2000), (2000, 1), (2, 3), (7, 500), (375, 500), (500, 375), (4000, 30)])
def test_crop_box_stays_inside_the_image(height, width):
  rng = np.random.default_rng(0)
  for _ in range(300):
    top, left, h, w = images.random_resized_crop_box(height, width, rng)
    assert 1 <= h <= height and 1 <= w <= width
    assert 0 <= top <= height - h and 0 <= left <= width - w


@pytest.mark.parametrize("height,width,box", [
    (100, 1000, (0, 433, 100, 133)),  # too wide: full height, width at ratio 4/3
    (1000, 100, (433, 0, 133, 100)),  # too tall: full width, height at ratio 3/4
    (300, 300, (0, 0, 300, 300)),     # ratio within range: the whole image
])
def test_crop_falls_back_to_the_centre_when_no_draw_fits(height, width, box):
  rng = np.random.default_rng(0)
  # attempts=0: no draw at all, straight to the fallback.
  assert images.random_resized_crop_box(height, width, rng, attempts=0) == box


# --- the pipelines ------------------------------------------------------------

@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
  return [images.synthetic_record(i, classes=10, seed=0) for i in range(12)]


@pytest.mark.parametrize("size", [224, 64, 1])
def test_train_output_is_uint8_rgb_of_the_requested_size(jpegs, size):
  ds = _pipeline(jpegs, size=size)
  for i in (0, 3, 11):
    out = ds[i]
    assert set(out) == {"image", "label"}
    assert out["image"].dtype == np.uint8 and out["image"].shape == (size, size, 3)
    assert out["image"].flags.c_contiguous
    assert out["label"].dtype == np.int64 and out["label"] == i % 10


def test_train_is_a_function_of_seed_and_index(jpegs):
  a, b = _pipeline(jpegs, seed=1), _pipeline(jpegs, seed=1)
  for i in range(len(jpegs)):
    assert a[i]["image"].tobytes() == b[i]["image"].tobytes(), i
  other = _pipeline(jpegs, seed=2)
  assert any(a[i]["image"].tobytes() != other[i]["image"].tobytes() for i in range(len(jpegs)))
  # The same record at other positions gets other crops.
  same = _pipeline([jpegs[0]] * 16)
  assert len({same[i]["image"].tobytes() for i in range(16)}) == 16


def test_flip_and_crop_can_be_turned_off():
  """scale (1, 1) with ratio covering the image's is the whole image, resized."""
  pixels = _smooth(48, 64)
  ds = _pipeline([images.encode_image_record(0, _png(pixels))] * 8, size=32,
                 scale=(1.0, 1.0), ratio=(0.5, 2.0), flip=False)
  want = cv2.resize(pixels, (32, 32), interpolation=cv2.INTER_LINEAR_EXACT)
  for i in range(8):
    np.testing.assert_array_equal(ds[i]["image"], want)


def test_eval_resizes_the_shorter_side_then_centre_crops():
  pixels = _smooth(200, 300)
  ds = images.eval_pipeline(grain.MapDataset.source(
      [images.encode_image_record(4, _png(pixels))]), size=112)
  resized = cv2.resize(pixels, (192, 128), interpolation=cv2.INTER_LINEAR_EXACT)  # 112/0.875
  np.testing.assert_array_equal(ds[0]["image"], resized[8:120, 40:152])
  assert ds[0]["label"] == 4


@pytest.mark.parametrize("kind", [
    "rgb_jpeg", "gray_jpeg", "gray_png", "rgb_png", "rgba_png", "rgb16_png", "cmyk_jpeg",
    "tiny_jpeg", "thin_png", "tall_png"])
def test_every_input_kind_gives_rgb(kind):
  rgb = _smooth(40, 60)
  if kind == "rgb_jpeg":
    data, want = _jpeg(rgb), rgb
  elif kind == "gray_jpeg":
    data, want = _jpeg(rgb[..., :1]), np.repeat(rgb[..., :1], 3, axis=2)
  elif kind == "gray_png":
    data, want = _png(rgb[..., 0]), np.repeat(rgb[..., :1], 3, axis=2)
  elif kind == "rgb_png":
    data, want = _png(rgb), rgb
  elif kind == "rgba_png":
    data, want = _png(np.concatenate([rgb, rgb[..., :1]], axis=2)), rgb
  elif kind == "rgb16_png":
    data, want = _png(rgb.astype(np.uint16) * 257), rgb
  elif kind == "cmyk_jpeg":
    pil = pytest.importorskip("PIL.Image")
    import io  # pylint: disable=g-import-not-at-top
    buf = io.BytesIO()
    pil.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=95)
    data, want = buf.getvalue(), rgb
  elif kind == "tiny_jpeg":
    data, want = _jpeg(rgb[:1, :1]), rgb[:1, :1]
  elif kind == "thin_png":
    data, want = _png(rgb[:1]), rgb[:1]
  else:
    data, want = _png(rgb[:, :1]), rgb[:, :1]
  decoded = images.decode_image(data)
  assert decoded.dtype == np.uint8 and decoded.shape == want.shape
  # JPEG is lossy: channels in the right order, within its error.
  tol = 0 if kind.endswith("png") else 12
  assert np.abs(decoded.astype(int) - want).max() <= tol, kind
  out = _pipeline([images.encode_image_record(1, data)] * 4, size=24)
  for i in range(4):
    assert out[i]["image"].shape == (24, 24, 3)


@pytest.mark.parametrize("what,data", [
    ("truncated", "half"), ("garbage", b"\x00" * 500), ("jpeg_header_only", "head"),
    ("empty", b""), ("flipped_bytes", "flip")])
def test_a_corrupt_image_is_data_loss_naming_its_position(jpegs, what, data):
  good = bytes(images.decode_image_record(jpegs[0])[1])
  data = {"half": good[:len(good) // 2], "head": good[:600],
          "flip": good[:3000] + bytes(b ^ 0x55 for b in good[3000:6000]) + good[6000:]
          }.get(data, data) if isinstance(data, str) else data
  records = [jpegs[1], jpegs[2], images.encode_image_record(3, data)]
  ds = _pipeline(records)
  ds[1]  # neighbours are fine
  with pytest.raises(DataLossError, match=r"the record at stream position 2 \(.* bytes, "
                                          r"image bytes starting .*\) is not a readable image"):
    ds[2]


def test_a_record_without_a_label_is_data_loss():
  with pytest.raises(DataLossError, match="position 0 .* shorter than its 8-byte label"):
    _pipeline([b"\x01\x02"])[0]


def test_bad_options_are_refused():
  ds = grain.MapDataset.source([b""]).seed(0)
  for kwargs in ({"size": 0}, {"size": 2.5}, {"scale": (0.5, 0.1)}, {"ratio": (0, 1)}):
    with pytest.raises(ValueError):
      images.train_pipeline(ds, **kwargs)
  with pytest.raises(ValueError):
    images.eval_pipeline(ds, crop_fraction=1.5)


def test_synthetic_jpegs_are_imagenet_sized(tmp_path):
  paths = images.write_synthetic_jpegs(str(tmp_path), 10, classes=3, seed=0)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["class_000", "class_001", "class_002"]
  sizes = [pathlib.Path(p).stat().st_size for p in paths]
  assert 80_000 < np.mean(sizes) < 140_000, sizes
  for i, p in enumerate(paths):
    assert pathlib.Path(p).parent.name == f"class_{i % 3:03d}"
    h, w = images.decode_image(pathlib.Path(p).read_bytes()).shape[:2]
    assert {h, w} <= set(range(340, 541)), (h, w)
    assert pathlib.Path(p).read_bytes() == bytes(images.decode_image_record(
        images.synthetic_record(i, classes=3, seed=0))[1])


# --- through a real server ----------------------------------------------------

@pytest.fixture(scope="module")
def image_config(tmp_path_factory) -> str:
  root = tmp_path_factory.mktemp("images")
  records = [images.synthetic_record(i, classes=10, seed=1) for i in range(NUM_RECORDS)]
  examples.write_shards(str(root / "img"), NUM_RECORDS, records.__getitem__, num_shards=2)
  bad = list(records[:12])
  bad[CORRUPT_AT] = images.encode_image_record(9, b"\xff\xd8 not really a jpeg")
  examples.write_shards(str(root / "bad"), len(bad), bad.__getitem__, num_shards=1)
  (root / "elevator.toml").write_text(CONFIG)
  return str(root / "elevator.toml")


@pytest.fixture(scope="module")
def image_server(serve, image_config):
  return serve(image_config, workers=2)


@pytest.mark.parametrize("dataset,g,n,h", [
    ("train", 8, 1, 0), ("train", 8, 2, 1), ("train", 16, 2, 0), ("eval", 10, 2, 1)])
def test_served_batches_are_embedded_modes(image_server, image_config, dataset, g, n, h):
  with RemoteDataset(image_server.target, dataset, g, shard_index=h,
                     shard_count=n) as remote:
    with RemoteDataset.embedded(image_config, dataset, g, shard_index=h, shard_count=n,
                                prefetch=0) as local:
      steps = assert_streams_equal(remote, local)
  epochs = 2 if dataset == "train" else 1
  assert steps == NUM_RECORDS * epochs // g


def test_served_corrupt_image_is_data_loss_naming_dataset_step_and_position(image_server):
  with RemoteDataset(image_server.target, "corrupt", 4, prefetch=0) as ds:
    it = iter(ds)
    assert next(it)["image"].shape == (4, 32, 32, 3)  # step 0: records 0-3
    with pytest.raises(DataLossError) as info:
      next(it)  # step 1 holds record 5
  assert info.value.code.name == "DATA_LOSS"
  assert (f"dataset 'corrupt', step 1: the record at stream position {CORRUPT_AT} "
          in str(info.value)), str(info.value)
  assert "is not a readable image" in str(info.value)
  with RemoteDataset(image_server.target, "corrupt", 4) as ds:  # the worker still serves
    it = iter(ds)
    it.set_state({**it.get_state(), "step": 2})
    assert next(it)["label"].tolist() == [8, 9, 0, 1]
