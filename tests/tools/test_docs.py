"""The documentation: the site builds with `mkdocs build --strict` (a broken
link or anchor, a missing API reference or a docstring warning fails it),
what docs/hooks.py generates from the code is there, and the README stays a
front page whose links all lead somewhere."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

from grain_elevator.server.serving import options as options_lib
from helpers import ROOT

README_MAX_LINES = 300


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
