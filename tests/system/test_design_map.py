"""docs/design.md's map of the code names every module, in the section of
its package, and names none that is gone.

It works on file names, not paths: a module moved between folders of its
package (server/data/ into server/data/streams/, say) still counts as named,
so the map's folder rows may lag a move; a new module, or a renamed one,
fails here until the map says what it is.
"""

from __future__ import annotations

import fnmatch
import pathlib
import re

from helpers import ROOT

DESIGN = ROOT / "docs" / "design.md"
# The packages and the heading of the section of the map that describes each.
SECTIONS = {
    "proto": "### proto/",
    "server": "### server/",
    "client": "### client/",
    "pipelines": "### pipelines/ and tools/",
    "tools": "### pipelines/ and tools/",
}
# Folders the map names as a whole: benchmarks, each run by its name
# (BENCHMARKS.md says what each measures).
WHOLE = {"tools/bench": "`bench/`"}
SOURCES = ("*.py", "*.c", "*.proto")


def _section(text: str, heading: str) -> str:
  """The text under `heading`, up to the next heading of its level or above."""
  start = text.index(heading + "\n") if heading + "\n" in text else text.index(heading)
  end = re.search(r"^#{1,3} ", text[start + len(heading):], re.MULTILINE)
  return text[start:start + len(heading) + end.start()] if end else text[start:]


def _modules(package: str) -> list[pathlib.Path]:
  """Every source file of `package` (its __init__.py files aside), outside
  the folders the map names as a whole."""
  out = []
  for pattern in SOURCES:
    for path in (ROOT / package).rglob(pattern):
      relative = path.relative_to(ROOT).as_posix()
      if path.name == "__init__.py" or any(relative.startswith(w + "/") for w in WHOLE):
        continue
      out.append(path)
  return sorted(out)


def _named(name: str, section: str) -> bool:
  """Whether `name` is in `section`, as itself or by a `glob*` it names."""
  if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", section):
    return True
  globs = [g for g in re.findall(r"`([^`\s]+)`", section) if "*" in g]
  return any(fnmatch.fnmatch(name, g.rpartition("/")[2]) for g in globs)


def test_every_module_is_on_the_map():
  text = DESIGN.read_text()
  missing = [path.relative_to(ROOT).as_posix()
             for package, heading in SECTIONS.items()
             for path in _modules(package)
             if not _named(path.name, _section(text, heading))]
  for folder, named in WHOLE.items():
    if named not in _section(text, SECTIONS[folder.partition("/")[0]]):
      missing.append(folder + "/")
  assert not missing, (
      "docs/design.md's map (\"The shape of the code\") does not name: "
      + ", ".join(missing) + "; say in its package's section what each is")


def test_the_map_names_no_module_that_is_gone():
  """A `name.py` in a package's section exists in that package; a path with
  a folder in it exists from the checkout's root."""
  text = DESIGN.read_text()
  gone = []
  for heading in dict.fromkeys(SECTIONS.values()):
    packages = [p for p, h in SECTIONS.items() if h == heading]
    names = {p.name for package in packages for p in _modules(package)}
    names |= {p.name for package in packages for pattern in SOURCES
              for p in (ROOT / package).rglob(pattern)}
    for token in re.findall(r"`([^`\s]+\.(?:py|c|proto))`", _section(text, heading)):
      if "*" in token:
        continue
      if "/" in token:
        if not (ROOT / token).exists() and not any(
            (ROOT / p / token).exists() for p in packages):
          gone.append(token)
      elif token not in names:
        gone.append(token)
  assert not gone, f"docs/design.md's map names what is not in the code: {sorted(set(gone))}"
