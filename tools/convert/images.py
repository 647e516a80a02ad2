"""`elevator convert images`: an ImageNet-style folder into ArrayRecord.

Layout: ``DIR/<class name>/**/<file>``, one subfolder per class. Labels are
the class folders in sorted name order (label i = the i-th name; also
written to OUT_DIR/labels.txt, line i = label i). Records are ordered by
label, then by the file's path inside its class folder (sorted, '/'
separated). Files named .jpg/.jpeg/.jpe/.png (any case) are images; their
first bytes must be a JPEG or PNG signature, else they are skipped and
counted (or, with ``strict``, fail the conversion). Hidden files and
folders (a leading '.') and other file names are left out.

A record is::

  label: int64 little-endian (8 bytes) | the image file's bytes, unchanged

which `grain_elevator.pipelines.images` decodes (its `train_pipeline`).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any, Iterator, Sequence

from grain_elevator.tools.convert import shards
from grain_elevator.tools.convert import snippet as snippet_lib
from grain_elevator.tools.convert.errors import ConvertError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".png")
_SIGNATURES = {b"\xff\xd8\xff": "JPEG", b"\x89PNG\r\n\x1a\n": "PNG"}
_LABEL = struct.Struct("<q")
PIPELINE = "grain_elevator.pipelines.images:train_pipeline"
DEFAULT_SIZE = 224


def _encode_image_record(label: int, image: bytes) -> bytes:
  """``label:int64 LE | image bytes`` (the layout pipelines/images.py reads)."""
  return _LABEL.pack(label) + image


try:  # the record format's home
  from grain_elevator.pipelines.images import encode_image_record  # pylint: disable=g-import-not-at-top
except ImportError:  # the Beam venv: pipelines/images.py imports grain_elevator.proto (grpc)
  encode_image_record = _encode_image_record


def image_format(head: bytes) -> str | None:
  """"JPEG" or "PNG" from a file's first bytes, else None."""
  for signature, name in _SIGNATURES.items():
    if head.startswith(signature):
      return name
  return None


@dataclasses.dataclass(frozen=True)
class Segment:
  label: int
  folder: str
  files: tuple[str, ...]  # paths relative to the class folder


@dataclasses.dataclass(frozen=True)
class ImageFolderSource:
  root: str
  classes: tuple[str, ...]
  strict: bool = False
  kind = "images"

  @classmethod
  def of(cls, root: str, *, strict: bool = False) -> "ImageFolderSource":
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
      raise ConvertError(f"{root} is not a folder")
    classes = sorted(e.name for e in os.scandir(root)
                     if e.is_dir() and not e.name.startswith("."))
    if not classes:
      raise ConvertError(f"{root} has no class subfolders (expected DIR/<class>/<images>)")
    bad = [c for c in classes if "\n" in c or "\r" in c]
    if bad:
      raise ConvertError(f"class folder name {bad[0]!r} holds a line break")
    return cls(root, tuple(classes), strict)

  def units(self) -> list[str]:
    return [os.path.join(self.root, c) for c in self.classes]

  def index(self, unit: str) -> shards.Indexed:
    files, skipped, nbytes = [], [], 0
    for folder, dirs, names in os.walk(unit):
      dirs[:] = [d for d in dirs if not d.startswith(".")]
      for name in names:
        if name.startswith("."):
          continue
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, unit).replace(os.sep, "/")
        if not name.lower().endswith(IMAGE_EXTENSIONS):
          skipped.append((path, "not named as an image (.jpg, .jpeg, .png)"))
          continue
        try:
          with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
        except OSError as e:
          raise ConvertError(f"cannot read {path}: {e}") from e
        if image_format(head) is None:
          why = f"not a JPEG or PNG file (it starts with {head[:4].hex()})"
          if self.strict:
            raise ConvertError(f"{path}: {why} (--strict)")
          skipped.append((path, why))
          continue
        files.append((rel, size))
        nbytes += size
    files.sort()
    return shards.Indexed(len(files), nbytes, tuple(rel for rel, _ in files),
                          tuple(sorted(skipped)))

  def segment(self, unit: str, indexed: shards.Indexed, start: int, stop: int) -> Segment:
    label = self.classes.index(os.path.basename(unit))
    return Segment(label, unit, indexed.data[start:stop])

  def read(self, segment: Segment, stats: dict[str, Any]) -> Iterator[bytes]:
    for rel in segment.files:
      path = os.path.join(segment.folder, *rel.split("/"))
      try:
        with open(path, "rb") as f:
          data = f.read()
      except OSError as e:
        raise ConvertError(f"cannot read {path}: {e}") from e
      if image_format(data[:8]) is None:
        raise ConvertError(f"{path} is no longer a JPEG or PNG file: did the input "
                           "change while converting?")
      yield encode_image_record(segment.label, data)

  def merge_stats(self, stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {}

  def check(self, indexes: Sequence[tuple[str, shards.Indexed]]) -> None:
    pass

  def side_files(self) -> dict[str, bytes]:
    return {shards.LABELS_FILE: "".join(c + "\n" for c in self.classes).encode()}

  def serving(self, stats: dict[str, Any]) -> snippet_lib.Serving:
    comments = [f"records: label:int64 LE | image file bytes; {len(self.classes)} labels "
                f"(line i of {shards.LABELS_FILE} = label i):"]
    line = ""
    for i, c in enumerate(self.classes):
      item = f"{i}={c}"
      if line and len(line) + len(item) > 90:
        comments.append("  " + line.rstrip(", "))
        line = ""
      line += item + ", "
    comments.append("  " + line.rstrip(", "))
    return snippet_lib.Serving(pipeline=PIPELINE, options={"size": DEFAULT_SIZE},
                               comments=tuple(comments))
