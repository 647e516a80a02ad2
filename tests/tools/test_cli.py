"""The `elevator` command: describe against a real server and a local
config, health, make-dataset, serve's flags against ServerOptions, and
every default a help text shows is the flag's own. The command runs as a
process of its own; the server it asks is the session's in-process one
(conftest's serve), which answers over gRPC as `elevator serve` does."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess

import pytest

from grain_elevator.server import ServerOptions
from grain_elevator.server.serving import options as options_lib
from grain_elevator.tools import cli
from grain_elevator.tools.testing.launcher import ELEVATOR
from helpers import ROOT


@pytest.mark.parametrize("local", [False, True])
def test_describe(serve, config_path, local):
  target = f"local:{config_path}" if local else serve().target
  result = subprocess.run([*ELEVATOR, "describe", target, "--dataset", "aug2", "-G", "96"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  (info,) = json.loads(result.stdout)
  assert info["name"] == "aug2" and info["num_records"] == 1000
  assert (info["steps_per_epoch"], info["total_steps"]) == (10, 20)
  assert {"path": "image", "dtype": "uint8", "shape": [4, 4, 3]} in info["element_spec"]


def test_describe_unknown_dataset(serve):
  result = subprocess.run([*ELEVATOR, "describe", serve().target, "--dataset", "nope"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "elevator: error: unknown dataset 'nope'" in result.stderr


def test_health(serve):
  result = subprocess.run([*ELEVATOR, "health", serve().target],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0 and "SERVING" in result.stdout
  result = subprocess.run([*ELEVATOR, "health", "127.0.0.1:1", "--timeout", "1"],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


@pytest.mark.slow  # writes 10,000 records in a subprocess
@pytest.mark.parametrize("fmt", ["tfds", "arrayrecord"])
def test_make_dataset_writes_a_servable_config(tmp_path, fmt):
  result = subprocess.run([*ELEVATOR, "make-dataset", str(tmp_path), "--source", "generated",
                           "--format", fmt],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  result = subprocess.run([*ELEVATOR, "describe", f"local:{tmp_path}/elevator.toml"],
                          capture_output=True, text=True, timeout=120)
  (info,) = json.loads(result.stdout)
  assert info["name"] == "generated" and info["num_records"] == 10_000


def _serve_parser() -> argparse.ArgumentParser:
  sub = next(a for a in cli.build_parser()._actions  # pylint: disable=protected-access
             if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  return sub.choices["serve"]


def test_serve_flags_are_the_server_options():
  """One flag per ServerOptions field, named for it, with its default: the
  CLI and the Python API cannot drift apart."""
  actions = {a.dest: a for a in _serve_parser()._actions  # pylint: disable=protected-access
             if a.option_strings and a.dest not in ("help", "config")}
  fields = {f.name: f for f in dataclasses.fields(ServerOptions)}
  assert set(actions) == set(fields)
  for name, action in actions.items():
    assert action.option_strings == ["--" + name.replace("_", "-")], name
    assert action.default == fields[name].default, name
    assert fields[name].metadata["help"] in action.help, name


@pytest.mark.parametrize("argv,options", [
    ([], ServerOptions()),
    (["--grace-s", "20", "--workers", "auto", "--threads", "40", "--bulk", "off",
      "--metrics-port", "off", "--idle-exit-s", "never", "--batch-cache-mb", "auto"],
     ServerOptions(grace_s=20.0, threads=40, bulk=False)),
    (["--workers", "3", "--bulk", "on", "--bulk-port", "7001", "--metrics-port", "0",
      "--idle-exit-s", "2.5", "--batch-cache-mb", "0", "--write-timeout-s", "4"],
     ServerOptions(workers=3, bulk=True, bulk_port=7001, metrics_port=0, idle_exit_s=2.5,
                   batch_cache_mb=0, write_timeout_s=4.0)),
])
def test_serve_flags_parse_into_server_options(argv, options):
  args = _serve_parser().parse_args(["--config", "x.toml", *argv])
  assert options_lib.from_arguments(args) == options


@pytest.mark.parametrize("argv,message", [
    (["--workers", "many"], "--workers: expected a whole number or 'auto', got 'many'"),
    (["--bulk", "yes"], "--bulk: expected one of auto, on, off, got 'yes'"),
    (["--grace", "3"], "unrecognized arguments: --grace"),
])
def test_a_bad_serve_flag_names_itself(argv, message):
  result = subprocess.run([*ELEVATOR, "serve", "--config", "x.toml", *argv],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and message in result.stderr, result.stderr


def _parsers(parser: argparse.ArgumentParser, prog: str = "elevator"):
  """(prog, parser) of `parser` and every subcommand under it."""
  yield prog, parser
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for name, sub in action.choices.items():
        yield from _parsers(sub, f"{prog} {name}")


def test_a_default_a_help_text_shows_is_the_flags_own():
  """Where a flag's default is a number, the number its help shows is it
  (0 and None stand for a default said in words, as bench's --small-records)."""
  checked = 0
  for prog, parser in _parsers(cli.build_parser()):
    formatter = parser._get_formatter()  # pylint: disable=protected-access
    for action in parser._actions:  # pylint: disable=protected-access
      if not action.help or isinstance(action.default, bool) or not isinstance(
          action.default, (int, float)) or action.default == 0:
        continue
      shown = re.search(r"\(default:? ([\d,.]+)( [KMG]iB)?",
                        formatter._expand_help(action))  # pylint: disable=protected-access
      if shown:
        unit = {None: 1, " KiB": 1 << 10, " MiB": 1 << 20, " GiB": 1 << 30}[shown.group(2)]
        assert float(shown.group(1).replace(",", "")) * unit == action.default, (
            prog, action.option_strings)
        checked += 1
  assert checked >= 10, checked


def test_no_help_text_writes_a_default_of_its_own():
  """`(default 5)` in a source is a second copy of a number the code has:
  a help text says %(default)s, or formats the constant the code uses."""
  written = re.compile(r"\(default:? \d")
  found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
           for path in sorted((ROOT / "tools").rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if written.search(line) and not line.lstrip().startswith("#")]
  assert not found, "\n".join(found)
