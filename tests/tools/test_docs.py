"""The documentation: the site builds with `mkdocs build --strict` (a broken
link or anchor, a missing API reference or a docstring warning fails it),
what docs/hooks.py generates from the code is there, the tables committed
in the pages (metrics, errors) are what the code renders, and the README
stays a front page whose links all lead somewhere."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import sys

from grain_elevator.server.serving import options as options_lib
from helpers import ROOT

README_MAX_LINES = 300


@functools.cache
def _hooks():
  """docs/hooks.py, the site's generator, as a module."""
  spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_generated_sections_are_what_the_code_renders():
  """A metric or an error added in the code and not in the committed tables
  fails here; `python docs/hooks.py` rewrites them."""
  hooks = _hooks()
  assert not hooks.stale_sections(), "run `python docs/hooks.py` to rewrite them"
  pages = {p.relative_to(ROOT).as_posix(): p.read_text() for p in hooks.section_files()}
  for name in hooks.SECTIONS:
    assert any(hooks.section_start(name) in text for text in pages.values()), name


def test_every_metric_and_every_error_is_in_the_docs():
  """Every error class of proto/errors.py is in its table (ERRORS), which the
  docs' tables are rendered from; so is every metric of the catalog."""
  from grain_elevator.proto import errors  # pylint: disable=import-outside-toplevel
  from grain_elevator.server.serving.metrics import catalog  # pylint: disable=import-outside-toplevel
  defined = {cls for cls in vars(errors).values() if isinstance(cls, type)
             and issubclass(cls, errors.ElevatorError) and cls is not errors.ElevatorError}
  assert defined == set(errors.ERRORS), "an error class missing from errors.ERRORS"
  operations = (ROOT / "docs" / "operations.md").read_text()
  for m in catalog.METRICS:
    assert f"`{m.scraped_name}" in operations, m.name
  for page in ("protocol.md", "client.md"):
    text = (ROOT / "docs" / page).read_text()
    for cls in errors.ERRORS:
      assert f"| `{cls.__name__}` | `{cls.code.name}` |" in text, (page, cls.__name__)


def test_a_stale_section_is_rendered_again():
  hooks = _hooks()
  end = "<!-- end generated: errors -->"
  stale = f"before\n{hooks.section_start('errors')}\n\n| old |\n\n{end}\nafter\n"
  fresh = hooks.regenerate(stale)
  assert fresh != stale and "| old |" not in fresh
  assert "`DataLossError` | `DATA_LOSS`" in fresh
  assert fresh.startswith("before\n") and fresh.endswith(f"{end}\nafter\n")
  assert hooks.regenerate(fresh) == fresh


def test_the_site_builds_strict_without_a_warning(tmp_path):
  site = tmp_path / "site"
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
       "-d", str(site)],
      check=False, capture_output=True, text=True, timeout=300,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert not [line for line in output.splitlines() if "WARNING" in line], output

  # Every placeholder was filled: an unknown one fails the build, a malformed
  # one would be left in the page.
  for page in site.rglob("*.html"):
    assert "{{" not in page.read_text(), f"{page.relative_to(site)} has an unfilled {{{{ }}}}"
  # The home and benchmarks pages are made from README.md and BENCHMARKS.md.
  assert "One example" in (site / "index.html").read_text()
  assert "elevator bench" in (site / "benchmarks" / "index.html").read_text()
  # The CLI reference is generated from the parser: every ServerOptions field
  # is a flag there.
  cli = (site / "cli" / "index.html").read_text()
  for field in dataclasses.fields(options_lib.ServerOptions):
    assert options_lib.flag(field.name) in cli, field.name
  # The API reference came from the docstrings.
  assert "global_batch_size" in (site / "reference" / "client" / "index.html").read_text()


def test_the_readme_is_a_front_page_whose_links_exist():
  text = (ROOT / "README.md").read_text()
  lines = text.count("\n")
  assert lines <= README_MAX_LINES, (
      f"README.md has {lines} lines; it is the front page: move detail into docs/")
  links = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
  assert links
  for link in links:
    if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
      continue
    path = link.partition("#")[0]
    assert (ROOT / path).exists(), f"README.md links to {link}, which does not exist"


def test_the_readme_layout_puts_each_name_where_it_is_defined():
  """Each folder of README.md's Layout table exists, and a class a row names
  (`ServerOptions`) is defined in that folder."""
  text = (ROOT / "README.md").read_text()
  layout = text[text.index("## Layout"):]
  layout = layout[:layout.index("\n## ", 1)]
  rows = re.findall(r"^\| `([\w/.-]+/)` \| (.*) \|$", layout, re.MULTILINE)
  assert len(rows) >= 10
  for folder, what in rows:
    assert (ROOT / folder).is_dir(), f"README.md's Layout names {folder}, which does not exist"
    sources = "\n".join(p.read_text() for p in (ROOT / folder).rglob("*.py"))
    for name in re.findall(r"`([A-Z]\w+)`", what):
      assert re.search(rf"^class {name}\b", sources, re.MULTILINE), (
          f"README.md's Layout puts {name} in {folder}, which does not define it")
