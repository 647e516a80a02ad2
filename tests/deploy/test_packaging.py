"""Every package folder ships in the wheel (a plain `pip install .`)."""

from __future__ import annotations

import tomllib

from helpers import ROOT



def test_every_package_folder_is_listed():
  tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  listed = set(tool["packages"])
  found = set()
  for prefix, folder in tool["package-dir"].items():
    for init in (ROOT / folder).rglob("__init__.py"):
      rel = init.parent.relative_to(ROOT / folder).parts
      found.add(".".join((prefix, *rel)))
  assert found == listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
