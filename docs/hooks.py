"""Build-time generation for the documentation site (mkdocs.yml `hooks:`).

One fact, one place: a default, a limit, a flag or a status list that the
code defines is rendered from the code when the site is built, never copied
into a page.

  * `{{ NAME }}` in a page is the value of a constant or default (`VALUES`
    and `DEFAULTS` below) with its unit: `{{ MAX_REQUEST_BYTES }}` is
    "64 KiB". `{{ NAME | cited }}` adds where it is defined:
    "64 KiB (`MAX_REQUEST_BYTES`, `proto/limits.py`)".
  * `{{ serve_flags }}`, `{{ cli }}`, `{{ elevator_proto }}` and the other
    names in `BLOCKS` are whole tables and listings made from the code. An
    unknown name fails the build.
  * Tables a reader needs on GitHub too (the metrics, the errors) are
    committed in the pages between `<!-- generated: NAME ... -->` and
    `<!-- end generated: NAME -->`, rendered by `SECTIONS` below:
    `python docs/hooks.py` rewrites them from the code, `--check` lists the
    stale ones, and a stale one fails the build and tests/tools/test_docs.py.
  * README.md and BENCHMARKS.md are the site's home and benchmarks pages,
    made from the files themselves when the site is built (no second copy).
  * Links are written for GitHub (`../BENCHMARKS.md`, `docs/design.md`);
    links to those two files and into docs/ are rewritten to site pages.
  * mkdocstrings: `grain_elevator.*` maps to the checkout's top-level
    folders (pyproject.toml's package-dir), which griffe cannot resolve
    statically. The hook lays the packages out as `grain_elevator/<name>`
    symlinks in a temporary folder and points the python handler's `paths`
    there, so the API reference is read from the source, nothing imported.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import fractions
import importlib
import inspect
import os
import pathlib
import posixpath
import re
import shutil
import tempfile
import tomllib
from collections.abc import Callable
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout
# Files outside docs/ that the site shows as pages: repository path -> page.
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md"}

# -- values --------------------------------------------------------------------

# Constants the pages name, by the module that defines them.
CONSTANTS = {
    "grain_elevator.proto.limits": ["MAX_REQUEST_BYTES", "LONG_STREAM_STEPS",
                                   "MAX_STREAM_STATE_BYTES", "MAX_SKIP_STEPS",
                                   "MAX_EXPLAIN_ROWS", "MAX_SUMMARY_ROWS",
                                   "MAX_STREAM_SUMMARY_ROWS", "MAX_SKIP_ROWS", "MAX_STREAM_SHARDS"],
    "grain_elevator.proto.rows": ["MIN_ROW_BYTES"],
    "grain_elevator.proto.wire": ["MIN_COMPRESSED_BYTES", "ZSTD_LEVEL"],
    "grain_elevator.proto.framing": ["MAGIC"],
    "grain_elevator.proto.errors": ["ERROR_TYPE_KEY"],
    "grain_elevator.proto.contract": ["MASK_KEY"],
    "grain_elevator.server.serving.bulk": ["HANDSHAKE_TIMEOUT_S"],
    "grain_elevator.server.serving.grpc_service": ["REQUEST_ARRIVAL_TIMEOUT_S"],
    "grain_elevator.server.serving.health": [
        "PROBE_TIMEOUT_S", "MAX_WAITING_PER_PEER", "MAX_WATCHES_PER_PEER", "MAX_WATCHES"],
    "grain_elevator.server.serving.health_port": [
        "HEALTH_MAX_CONNECTIONS", "HEALTH_MAX_CONNECTIONS_PER_PEER",
        "HEALTH_MAX_STREAMS_PER_CONNECTION", "HEALTH_FIRST_REQUEST_TIMEOUT_S",
        "HEALTH_IDLE_TIMEOUT_S", "HEALTH_MAX_REQUEST_BYTES", "HEALTH_MAX_HEADER_LIST_BYTES",
        "HEALTH_PEER_CPU_BURST_S", "HEALTH_PEER_CPU_REFILL_S", "HEALTH_MAX_PEERS",
        "HEALTH_MAX_UNSENT_BYTES",
        "HEALTH_MAX_CALLS_PER_CONNECTION"],
    "grain_elevator.server.serving.admission": ["STALL_GRACE_S", "SLICE_S"],
    "grain_elevator.server.serving.batch_cache": ["DEFAULT_WAIT_S"],
    "grain_elevator.server.serving.stream_sessions": ["MAX_STREAM_SESSIONS",
                                                     "MAX_TRACKED_HOSTS"],
    "grain_elevator.server.serving.metrics.catalog": ["UTILIZATION_WINDOW_S"],
    "grain_elevator.server.serving.metrics.scrape": [
        "SCRAPE_TIMEOUT_S", "MAX_SCRAPE_CONNECTIONS"],
    "grain_elevator.server.serving.options": [
        "HEALTH_THREADS", "BATCH_CACHE_MEMORY_FRACTION", "DEFAULT_BATCH_CACHE_CAP"],
    "grain_elevator.server.process.restarts": [
        "RESTART_DELAY_MIN_S", "RESTART_DELAY_MAX_S", "RESTART_STABLE_AFTER_S",
        "CRASH_LOOP_RESTARTS"],
    "grain_elevator.server.process.descriptors": [
        "RESERVED_DESCRIPTORS", "DESCRIPTORS_PER_SHARD"],
    "grain_elevator.server.process.supervisor": [
        "FORK_SERVER_TIMEOUT_S", "SUPERVISOR_JOIN_TIMEOUT_S"],
    "grain_elevator.server.process.step_board": ["MAX_FAILED_STEPS", "IN_FLIGHT_PER_WORKER"],
    "grain_elevator.server.serving.front_door": ["UNAUTHENTICATED_GRACE_S", "SWEEP_S"],
    "grain_elevator.server.data.shards.identity": ["IDENTITY_TAIL_BYTES"],
    "grain_elevator.server.data.shards.option_files": ["HASH_READ_BYTES"],
    "grain_elevator.server.data.storage.ranges": ["COALESCE_GAP_BYTES", "MAX_RANGE_BYTES"],
    "grain_elevator.server.data.storage.settings": ["DEFAULT_RETRY_S", "REQUEST_TIMEOUT_S"],
    "grain_elevator.server.data.storage.objects": ["MIN_IN_FLIGHT", "MAX_IN_FLIGHT",
                                                   "AHEAD_SHARE", "HEDGE_SHARE", "HEDGE_BURST",
                                                   "BACKOFF_FIRST_S", "BACKOFF_LAST_S"],
    "grain_elevator.server.data.storage.throttle": ["MIN_WINDOW", "CUT_INTERVAL_S"],
    "grain_elevator.server.data.storage.cache": ["BLOCK_BYTES", "FREE_SPACE_KEPT"],
    "grain_elevator.server.data.storage.cache_fill": ["FILL_IN_FLIGHT", "PROGRESS_S"],
    "grain_elevator.server.data.storage.read_ahead": ["STALE_S", "ROWS_PER_HOLD"],
    "grain_elevator.server.serving.read_plan": ["AHEAD_CHUNKS", "MAX_AHEAD_CHUNKS", "MAX_STEPS"],
    "grain_elevator.server.data.streams.head_reads": ["BLOCK", "BLOCKS_AHEAD",
                                                      "MAX_BLOCKS_AHEAD"],
    "grain_elevator.server.data.streams.parallel_head": [
        "TASK_ELEMENTS", "TASKS_AHEAD_PER_WORKER", "PROGRESS_EVERY_S", "PEER_SILENT_S",
        "REDIAL_S", "HEAD_LOG_PERIOD_S"],
    "grain_elevator.server.process.head_sockets": [
        "HEAD_HANDSHAKE_TIMEOUT_S", "MAX_HEAD_HANDSHAKES"],
    "grain_elevator.client.transport.connection": ["MAX_CONTROL_MESSAGE_BYTES"],
    "grain_elevator.client.transport.retry": ["RETRIABLE", "REFUSED"],
    "grain_elevator.client.state": ["CURSOR_VERSION", "MAX_SKIP_RANGES", "MAX_STATE_BYTES",
                                    "MAX_STATE_DEPTH", "MAX_STREAM_SKIP_ROWS"],
    "grain_elevator.server.data.provenance": ["EXPLAIN_VERSION"],
    "grain_elevator.client.stream_iterator": ["SKIP_ROWS_PER_CALL"],
    "grain_elevator.client.window": ["REQUEST_BYTES", "MAX_STEPS_PER_REQUEST"],
    "grain_elevator.client.request_size": ["REQUEST_S", "FIRST_STEPS"],
    "grain_elevator.client.transport.options": ["WINDOW_BYTES"],
    "grain_elevator.tools.convert.text": ["MAX_JSON_VALUES"],
}

# Objects whose defaults the pages name as `{{ Object.field }}`: dataclasses
# (their fields) or callables (their keyword arguments).
DEFAULTS = {
    "ServerOptions": "grain_elevator.server.serving.options:ServerOptions",
    "TransportOptions": "grain_elevator.client.transport.options:TransportOptions",
    "RetryPolicy": "grain_elevator.client.transport.options:RetryPolicy",
    "DatasetConfig": "grain_elevator.server.data.config:DatasetConfig",
    "RemoteDataset": "grain_elevator.client.remote_dataset:RemoteDataset",
    "to_device": "grain_elevator.client.device:to_device",
}


def _load(spec: str) -> Any:
  module, _, name = spec.partition(":")
  return getattr(importlib.import_module(module), name)


def _source_path(module: str) -> str:
  return pathlib.Path(importlib.import_module(module).__file__).resolve().relative_to(
      ROOT).as_posix()


def _bytes(n: int) -> str:
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if n >= 1 << shift and n % (1 << shift) == 0:
      return f"{n >> shift:,} {unit}"
  return f"{n:,} bytes"


def _format(name: str, value: Any) -> str:
  """A value as a page shows it, its unit from its name."""
  lower = name.lower()
  if isinstance(value, frozenset):  # gRPC status codes
    return ", ".join(f"`{c.name}`" for c in sorted(value, key=lambda c: c.value[0]))
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, bytes):
    return f"`{value.decode()}`"
  if isinstance(value, str):
    return f"`{value}`"
  if lower.endswith(("_bytes", "_cap")):
    return _bytes(value)
  if lower.endswith("_mb"):
    return f"{value:,} MiB"
  if lower.endswith("_s"):
    return f"{value:g} s"
  if lower.endswith("fraction"):
    return str(fractions.Fraction(value).limit_denominator(1000))
  if isinstance(value, float):
    return f"{value:g}"
  return f"{value:,}"


def _values() -> dict[str, tuple[str, str]]:
  """{placeholder: (value as shown, where it is defined)}."""
  out: dict[str, tuple[str, str]] = {}
  for module, names in CONSTANTS.items():
    where = _source_path(module)
    for name in names:
      out[name] = (_format(name, getattr(importlib.import_module(module), name)), where)
  for short, spec in DEFAULTS.items():
    obj = _load(spec)
    where = _source_path(obj.__module__)
    if dataclasses.is_dataclass(obj):
      for field in dataclasses.fields(obj):
        if field.default is dataclasses.MISSING:
          continue
        if field.default is None:
          shown = f"`{field.metadata.get('none', 'none')}`"
        else:
          shown = _format(field.name, field.default)
        out[f"{short}.{field.name}"] = (shown, where)
    else:
      target = obj.__init__ if inspect.isclass(obj) else obj
      for p in inspect.signature(target).parameters.values():
        if p.default is not inspect.Parameter.empty and p.default is not None and not (
            dataclasses.is_dataclass(p.default)):
          out[f"{short}.{p.name}"] = (_format(p.name, p.default), where)
  return out


# -- generated blocks ------------------------------------------------------------


def _serve_flags() -> str:
  """`elevator serve`'s flags as its parser has them (server/serving/options.py
  makes one per ServerOptions field, with the field's help and default)."""
  from grain_elevator.tools import cli  # pylint: disable=g-import-not-at-top
  serve = _subparsers(cli.build_parser())["serve"]
  rows = ["| flag | value | default | what it sets |", "|---|---|---|---|"]
  for action in serve._actions:  # pylint: disable=protected-access
    if not action.option_strings or action.dest == "help":
      continue
    help_text, default = action.help or "", "(required)" if action.required else ""
    given = re.fullmatch(r"(.*) \(default: (.*)\)", help_text, re.DOTALL)
    if given:
      help_text, default = given.group(1), f"`{given.group(2)}`"
    metavar = str(action.metavar or action.dest.upper())
    rows.append(f"| `{action.option_strings[-1]}` | {metavar.replace('|', ' or ')} | "
                f"{default} | {' '.join(help_text.split()).replace('|', chr(92) + '|')} |")
  return "\n".join(rows)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      return dict(action.choices)
  return {}


def _cli() -> str:
  """Every `elevator` command's --help, as argparse prints it."""
  from grain_elevator.tools import cli  # pylint: disable=g-import-not-at-top
  saved = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = "90"  # argparse wraps to the terminal's width
  try:
    parts = []

    def add(prog: str, parser: argparse.ArgumentParser, level: int) -> None:
      parts.append(f"{'#' * level} `{prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
      for name, sub in _subparsers(parser).items():
        add(f"{prog} {name}", sub, level + 1)

    for name, sub in _subparsers(cli.build_parser()).items():
      add(f"elevator {name}", sub, 2)
    return "\n".join(parts)
  finally:
    if saved is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = saved


def _cell(text: str) -> str:
  """`text` as one cell of a markdown table."""
  return " ".join(text.split()).replace("|", "\\|")


def _errors() -> str:
  """The error family and the status each travels as (proto/errors.py)."""
  from grain_elevator.proto import errors  # pylint: disable=g-import-not-at-top
  rows = ["| error | status | meaning |", "|---|---|---|"]
  for cls in errors.ERRORS:
    rows.append(f"| `{cls.__name__}` | `{cls.code.name}` | {_cell(inspect.getdoc(cls))} |")
  return "\n".join(rows)


def _metrics() -> str:
  """Every metric the server exports (server/serving/metrics/catalog.py)."""
  from grain_elevator.server.serving.metrics import catalog  # pylint: disable=g-import-not-at-top
  rows = ["| metric | kind | what it counts |", "|---|---|---|"]
  for m in catalog.METRICS:
    labels = "{" + ",".join(m.labels) + "}" if m.labels else ""
    what = f"{m.help} {m.notes}" if m.notes else m.help
    rows.append(f"| `{m.scraped_name}{labels}` | {m.kind} | {_cell(what)} |")
  return "\n".join(rows)


def _elevator_proto() -> str:
  text = (ROOT / "proto" / "elevator.proto").read_text()
  return f"```protobuf\n{text.rstrip()}\n```"


def _bulk_kinds() -> str:
  from grain_elevator.proto import framing  # pylint: disable=g-import-not-at-top
  rows = ["| kind | frame |", "|---|---|"]
  rows += [f"| {kind} | {name} |" for kind, name in framing.KINDS.items()]
  return "\n".join(rows)


def _descriptor_budget() -> str:
  """A worker's descriptor budget with the default connection caps."""
  from grain_elevator.server.process import descriptors  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.serving.options import ServerOptions  # pylint: disable=g-import-not-at-top
  o = ServerOptions()
  fixed = descriptors.Budget(o.max_bulk_connections, o.max_grpc_connections, 0).total
  return f"{fixed:,} + {descriptors.DESCRIPTORS_PER_SHARD} per shard"


def _worker_env() -> str:
  from grain_elevator.server.process import supervisor  # pylint: disable=g-import-not-at-top
  return ", ".join(f"`{k}={v}`" for k, v in supervisor.WORKER_ENV.items())


BLOCKS: dict[str, Callable[[], str]] = {
    "serve_flags": _serve_flags, "cli": _cli,
    "elevator_proto": _elevator_proto, "bulk_kinds": _bulk_kinds,
    "descriptor_budget": _descriptor_budget, "worker_env": _worker_env,
}

# -- generated sections, committed in the pages ---------------------------------------

SECTIONS: dict[str, Callable[[], str]] = {"metrics": _metrics, "errors": _errors}
# The pages (and README.md) that may hold sections.
SECTION_FILES = ("README.md", "docs/*.md")

_SECTION = re.compile(r"(<!-- generated: (?P<name>[\w-]+)\b[^\n]*?-->\n)(?P<body>.*?)"
                      r"(<!-- end generated: (?P=name) -->)", re.DOTALL)


def section_start(name: str) -> str:
  return f"<!-- generated: {name}, from the code by `python docs/hooks.py`; do not edit -->"


def regenerate(markdown: str, where: str = "") -> str:
  """`markdown` with every generated section rendered again from the code."""
  def one(m: re.Match[str]) -> str:
    name = m.group("name")
    if name not in SECTIONS:
      raise PluginError(f"{where}: unknown generated section {name!r}: add it to "
                        "docs/hooks.py (SECTIONS)")
    return f"{section_start(name)}\n\n{SECTIONS[name]().rstrip()}\n\n{m.group(4)}"
  return _SECTION.sub(one, markdown)


def section_files() -> list[pathlib.Path]:
  return sorted({p for pattern in SECTION_FILES for p in ROOT.glob(pattern)})


def stale_sections() -> list[str]:
  """The files whose generated sections differ from what the code renders."""
  return [p.relative_to(ROOT).as_posix() for p in section_files()
          if regenerate(text := p.read_text(), str(p)) != text]


_PLACEHOLDER = re.compile(r"\{\{\s*([\w.]+)\s*(\|\s*cited\s*)?\}\}")


class _Generated:
  """Everything the pages may name, computed once per build."""

  def __init__(self) -> None:
    self.values = _values()
    self.blocks: dict[str, str] = {}

  def render(self, markdown: str, page: str) -> str:
    def one(m: re.Match[str]) -> str:
      name, cited = m.group(1), bool(m.group(2))
      if name in BLOCKS and not cited:
        if name not in self.blocks:
          self.blocks[name] = BLOCKS[name]()
        return self.blocks[name]
      if name not in self.values:
        raise PluginError(f"{page}: unknown placeholder {{{{ {name} }}}}: add it to "
                          "docs/hooks.py (CONSTANTS, DEFAULTS or BLOCKS)")
      value, where = self.values[name]
      if cited:
        return f"{value} (`{name.rpartition('.')[2] if '.' in name else name}`, `{where}`)"
      return value
    return _PLACEHOLDER.sub(one, markdown)


# -- links written for GitHub -------------------------------------------------------

_LINK = re.compile(r"(\]\()([^)\s]+)(\s+\"[^\"]*\")?(\))")


def _repo_path(src_uri: str) -> str:
  for repo, site in ROOT_PAGES.items():
    if src_uri == site:
      return repo
  return f"docs/{src_uri}"


def _site_link(target: str, repo_path: str, src_uri: str) -> str:
  """`target`, a link in the file at `repo_path`, as a link of page `src_uri`."""
  if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
    return target
  path, hash_, anchor = target.partition("#")
  repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
  if repo_target in ROOT_PAGES:
    site_target = ROOT_PAGES[repo_target]
  elif repo_target.startswith("docs/"):
    site_target = repo_target[len("docs/"):]
  else:
    return target  # outside the site: mkdocs reports it
  link = posixpath.relpath(site_target, posixpath.dirname(src_uri) or ".")
  return link + hash_ + anchor


def _rewrite_links(markdown: str, repo_path: str, src_uri: str) -> str:
  """Rewrites inline links outside fenced code blocks."""
  pieces = re.split(r"(^[ \t]*```.*?^[ \t]*```[^\n]*$)", markdown, flags=re.MULTILINE | re.DOTALL)
  for i in range(0, len(pieces), 2):
    pieces[i] = _LINK.sub(
        lambda m: m.group(1) + _site_link(m.group(2), repo_path, src_uri)
        + (m.group(3) or "") + m.group(4), pieces[i])
  return "".join(pieces)


# -- mkdocstrings: the packages where griffe can find them ---------------------------

_PACKAGES_DIR: pathlib.Path | None = None


def _packages_dir() -> pathlib.Path:
  """A folder holding grain_elevator/<name> -> the checkout's folders, made
  once per process from pyproject.toml's package-dir."""
  global _PACKAGES_DIR  # pylint: disable=global-statement
  if _PACKAGES_DIR is None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    top = pathlib.Path(tempfile.mkdtemp(prefix="elevator-docs-"))
    atexit.register(shutil.rmtree, top, ignore_errors=True)
    (top / "grain_elevator").mkdir()
    for package, folder in package_dir.items():
      prefix, _, name = package.partition(".")
      if prefix != "grain_elevator" or "." in name:
        raise PluginError(f"pyproject.toml package-dir {package!r}: expected "
                          "grain_elevator.<name>")
      (top / "grain_elevator" / name).symlink_to(ROOT / folder, target_is_directory=True)
    _PACKAGES_DIR = top
  return _PACKAGES_DIR


# -- MkDocs events ---------------------------------------------------------------------

_generated: _Generated | None = None


@event_priority(100)  # before mkdocstrings' on_config, which creates the handler
def on_config(config: Any) -> Any:
  global _generated  # pylint: disable=global-statement
  handlers = config.plugins["mkdocstrings"].config.handlers
  handlers.setdefault("python", {})["paths"] = [str(_packages_dir())]
  _generated = _Generated()
  return config


def on_files(files: Any, config: Any) -> Any:
  for repo, site in ROOT_PAGES.items():
    if files.get_file_from_path(site) is not None:
      raise PluginError(f"docs/{site} is made from {repo}: remove docs/{site}")
    files.append(File.generated(config, site, abs_src_path=str(ROOT / repo)))
  return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
  src_uri = page.file.src_uri
  if regenerate(markdown, src_uri) != markdown:
    raise PluginError(f"{_repo_path(src_uri)}: a generated section differs from the code: "
                      "run `python docs/hooks.py`")
  markdown = _rewrite_links(markdown, _repo_path(src_uri), src_uri)
  return _generated.render(markdown, src_uri)


def on_serve(server: Any, config: Any, builder: Any) -> Any:
  """`mkdocs serve` (make docs) also rebuilds when README.md, BENCHMARKS.md or
  the packages change (the API reference follows the source; a value this
  hook imported needs a restart)."""
  for repo in ROOT_PAGES:
    server.watch(str(ROOT / repo))
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
    server.watch(str(ROOT / folder))
  return server


def main(argv: list[str] | None = None) -> int:
  """`python docs/hooks.py`: rewrites the generated sections from the code;
  `--check`: lists the stale ones and exits 1 if any."""
  parser = argparse.ArgumentParser(prog="python docs/hooks.py", description=main.__doc__)
  parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
  args = parser.parse_args(argv)
  stale = stale_sections()
  for path in stale:
    if args.check:
      print(f"{path}: generated sections differ from the code")
    else:
      (ROOT / path).write_text(regenerate((ROOT / path).read_text(), path))
      print(f"rewrote {path}")
  return 1 if stale and args.check else 0


if __name__ == "__main__":
  raise SystemExit(main())
