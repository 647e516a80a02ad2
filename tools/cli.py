"""The `elevator` command: a front end over the server and client APIs.

serve, describe and health need only the base install; demo, bench and
bench-feed need extras (demo, bench), imported when those commands run.

Each subcommand is two functions side by side: `_add_<name>` adds its
parser, `_<name>` runs it. A default a help text shows is the flag's own
(argparse's %(default)s) or the constant or keyword default of the module
that uses it, read when the parser is built: never a number of its own
(tests/tools/test_cli.py). Building the parser imports nothing slow (every
command builds it), so the benchmarks' defaults come from
tools/bench/defaults.py.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import sys
from typing import Any

from grain_elevator.proto import dtypes
from grain_elevator.proto.errors import ElevatorError
from grain_elevator.server.process import logs
from grain_elevator.server.serving import options as options_lib

_BENCH_WORKLOADS = "small,large"  # what `elevator bench` runs by default


def _keyword_defaults(fn: Any) -> dict[str, Any]:
  """`fn`'s keyword arguments' defaults, for the flags that pass them."""
  return {p.name: p.default for p in inspect.signature(fn).parameters.values()
          if p.default is not inspect.Parameter.empty}


def _serve(args: argparse.Namespace) -> int:
  from grain_elevator import server  # pylint: disable=g-import-not-at-top
  return server.serve(args.config, options_lib.from_arguments(args))


def _add_serve(sub: Any) -> None:
  p = sub.add_parser("serve", help="serve the datasets of a config file", allow_abbrev=False,
                     description="Serve the datasets of a config file. Every flag is a "
                                 "field of grain_elevator.server.ServerOptions, with the "
                                 "same name and default.")
  p.add_argument("--config", required=True, help="TOML file naming the datasets")
  options_lib.add_arguments(p)
  p.set_defaults(fn=_serve)


def _describe(args: argparse.Namespace) -> int:
  from grain_elevator.client import Security, describe  # pylint: disable=g-import-not-at-top
  security = Security.from_files(auth_token_file=args.auth_token_file)
  infos = describe(args.target, args.dataset or None, security=security)
  out = []
  for info in infos:
    row = {
        "name": info.name, "num_records": info.num_records,
        "num_epochs": info.num_epochs, "shuffle": info.shuffle,
        "seed": info.seed, "config_fingerprint": info.config_fingerprint,
        "element_spec": [
            {"path": l.path, "dtype": dtypes.dtype_to_str(l.dtype), "shape": list(l.shape)}
            for l in info.element_spec.leaves],
        "stream": info.stream,
    }
    if info.stream_shards > 1:
      row["stream_shards"] = info.stream_shards
    if args.global_batch_size and info.stream:  # steps are not known ahead
      row["total_steps"] = "forever" if info.repeats_forever else "unknown (a stream dataset)"
    elif args.global_batch_size:
      total = info.total_steps(args.global_batch_size)
      row["steps_per_epoch"] = info.steps_per_epoch(args.global_batch_size)
      row["total_steps"] = "forever" if total is None else total
    out.append(row)
  print(json.dumps(out, indent=2))
  return 0


def _add_describe(sub: Any) -> None:
  p = sub.add_parser("describe", help="show the datasets a server (or config) offers")
  p.add_argument("target", help="HOST:PORT, or local:CONFIG_PATH")
  p.add_argument("--dataset", default="", help="only this dataset")
  p.add_argument("-G", "--global-batch-size", type=int, default=0,
                 help="also show steps per epoch and in total for this G")
  p.add_argument("--auth-token-file", default=None,
                 help="file holding the bearer token of a server run with one")
  p.set_defaults(fn=_describe)


def _cursor_skip(args: argparse.Namespace) -> int:
  from grain_elevator.client import checkpoint  # pylint: disable=g-import-not-at-top
  try:
    saved = checkpoint.skip_saved(args.state, args.steps)
  except (OSError, json.JSONDecodeError) as e:
    print(f"elevator: error: cannot read or write the state {args.state}: {e}",
          file=sys.stderr)
    return 2
  skips = saved.get("skips", [])
  print(json.dumps({"state": str(args.state), "step": saved["step"], "skips": skips,
                    "resumes_at_step": max([saved["step"]] + [b for _, b in skips[-1:]])}))
  return 0


def _add_cursor(sub: Any) -> None:
  p = sub.add_parser("cursor", help="edit a saved iterator state (a cursor)")
  cursor = p.add_subparsers(dest="cursor_command", required=True)
  p = cursor.add_parser(
      "skip", help="skip the next N global batches of a saved state (rollback-and-skip)",
      description="Writes a skip of N global batches into a saved grain-elevator state, in "
                  "place: a JSON file, or a Grain checkpoint item directory "
                  "(process_*-of-*.json). A job restored from it drops the batches "
                  "[step, step + N), on any number of hosts; no server is needed now.")
  p.add_argument("state", help="the state's JSON file, or a Grain checkpoint item directory")
  p.add_argument("--steps", type=int, required=True, help="global batches to skip (N >= 0)")
  p.set_defaults(fn=_cursor_skip)


def _saved_position(state: str | None, step: int) -> dict[str, Any] | None | bool:
  """A stream's position at `step` from a cursor saved there (None: no
  file given; False: one that cannot say, of another step or unreadable,
  said on stderr)."""
  if not state:
    return None
  from grain_elevator.client import state as state_lib  # pylint: disable=g-import-not-at-top
  try:
    saved = state_lib.read(state)
  except OSError as e:
    print(f"elevator: error: cannot read the state {state}: {e}", file=sys.stderr)
    return False
  if not isinstance(saved, dict):
    print(f"elevator: error: {state} is not a saved state (a JSON object)", file=sys.stderr)
    return False
  if saved.get("step") != step:
    print(f"elevator: error: {state} is a state at step {saved.get('step')!r}, not {step}",
          file=sys.stderr)
    return False
  return saved.get("stream_state")


def _summary(args: argparse.Namespace, ds: Any) -> int:
  """`--summary START:END`: the counts as JSON; a stream's, traced call by
  call, with progress on a terminal."""
  start, sep, end = args.summary.partition(":")
  if not sep or not start.isdigit() or not end.isdigit():
    print(f"elevator: error: --summary takes START:END (whole steps), got {args.summary!r}",
          file=sys.stderr)
    return 2
  position = _saved_position(args.state, int(start))
  if position is False:
    return 2
  from rich.console import Console  # pylint: disable=g-import-not-at-top
  from rich.progress import Progress  # pylint: disable=g-import-not-at-top
  with Progress(console=Console(stderr=True), transient=True,
                disable=not sys.stderr.isatty()) as bar:
    task = bar.add_task("tracing steps", total=int(end) - int(start))
    counted = ds.summary(int(start), int(end), record_offset=args.record_offset,
                         stream_state=position, progress=lambda n: bar.advance(task, n))
  print(json.dumps(counted, indent=1))
  return 0


def _explain(args: argparse.Namespace) -> int:
  from grain_elevator.client import RemoteDataset, Security  # pylint: disable=g-import-not-at-top
  target = args.target
  if os.path.isfile(target) and not target.startswith("local:"):
    target = f"local:{target}"  # a config: embedded mode
  security = Security.from_files(auth_token_file=args.auth_token_file)
  ds = RemoteDataset(target, args.dataset, args.batch_size, shard_index=args.host,
                     shard_count=args.hosts, security=security)
  if args.summary:
    return _summary(args, ds)
  if args.step is None:
    print("elevator: error: give --step K (or --summary START:END)", file=sys.stderr)
    return 2
  position = _saved_position(args.state, args.step)
  if position is False:
    return 2
  explained = ds.explain(args.step, record_offset=args.record_offset, stream_state=position)
  if args.json:
    print(json.dumps(explained, indent=1))
    return 0
  print(f"dataset {explained['dataset']!r} ({explained['kind']}, fingerprint "
        f"{explained['config_fingerprint']}), step {explained['step']}, G="
        f"{explained['global_batch_size']}, host {explained['shard_index']} of "
        f"{explained['shard_count']}:")
  for row in explained["rows"]:
    if row.get("padding"):
      print(f"  row {row['global_row']}: padding (evaluation mode, past the end)")
      continue
    if "segments" in row:  # a stream dataset's packed row
      print(f"  row {row['global_row']}:")
      for seg in row["segments"]:
        where = (f"{seg['shard']} record {seg['record']}" if "shard" in seg
                 else seg.get("where", "record unknown"))
        print(f"    slots {seg['slot']}..{seg['slot'] + seg['length'] - 1}: element "
              f"{seg['element']} tokens {seg['token_offset']}.."
              f"{seg['token_offset'] + seg['length'] - 1}: {where}")
      continue
    part = f"component {row['component']!r} position {row['component_position']}, " if (
        "component" in row) else ""
    where = (f"{row['shard']} record {row['record']}" if "shard" in row
             else row.get("where", "?"))
    print(f"  row {row['global_row']}: position {row['position']}, {part}epoch "
          f"{row['epoch']}, source record {row['source_index']}: {where}")
  return 0


def _add_explain(sub: Any) -> None:
  p = sub.add_parser("explain", help="what a global step held: where each row came from",
                     description="For each row of a host's slice of global batch STEP: the "
                                 "record position, epoch, source record and its shard and "
                                 "record index (a mixture: the component too); evaluation "
                                 "padding marked. Exits 2 with the error for a step that does "
                                 "not exist.")
  p.add_argument("target", help="HOST:PORT of a server, or a config file (embedded mode)")
  p.add_argument("dataset", help="the dataset's name")
  p.add_argument("-G", "--batch-size", type=int, required=True, help="the global batch size")
  p.add_argument("--step", type=int, default=None,
                 help="the global step (the cursor's, counting skipped steps)")
  p.add_argument("--summary", default=None, metavar="START:END",
                 help="instead: counts per mixture component over global steps "
                      "[START, END), computed (JSON): records, or a stream's tokens, "
                      "segments and documents (each step traced)")
  p.add_argument("--host", type=int, default=0,
                 help="h, this host's index (default %(default)s)")
  p.add_argument("--hosts", type=int, default=1,
                 help="H, the number of hosts (default %(default)s)")
  p.add_argument("--record-offset", type=int, default=0,
                 help="the cursor's record_offset, after a change of G (default %(default)s)")
  p.add_argument("--state", default=None,
                 help="a stream dataset: a state JSON saved at STEP (or START), whose "
                      "position the trace starts from (default: found from the stream's "
                      "start, O(STEP))")
  p.add_argument("--json", action="store_true", help="print the JSON (docs/client.md)")
  p.add_argument("--auth-token-file", default=None,
                 help="file holding the bearer token of a server run with one")
  p.set_defaults(fn=_explain)


def _top(args: argparse.Namespace) -> int:
  from grain_elevator.tools import top  # pylint: disable=g-import-not-at-top
  try:
    return top.run(args.target, args.interval, once=args.once)
  except OSError as e:
    print(f"elevator: error: cannot scrape {args.target}: {e} (is the server run with "
          "--metrics-port?)", file=sys.stderr)
    return 2


def _add_top(sub: Any) -> None:
  from grain_elevator.tools import top  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("top", help="a live view of a server's metrics (--metrics-port)")
  p.add_argument("target", help="HOST:METRICS_PORT, or the /metrics URL")
  p.add_argument("--interval", type=float, default=_keyword_defaults(top.run)["interval_s"],
                 help="seconds between scrapes")
  p.add_argument("--once", action="store_true", help="print one view as text and exit")
  p.set_defaults(fn=_top)


def _health(args: argparse.Namespace) -> int:
  import grpc  # pylint: disable=g-import-not-at-top
  from grpc_health.v1 import health_pb2, health_pb2_grpc  # pylint: disable=g-import-not-at-top
  with grpc.insecure_channel(args.target) as channel:
    try:
      response = health_pb2_grpc.HealthStub(channel).Check(
          health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as e:
      print(f"{args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
      return 1
  status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
  print(f"{args.target}: {status}")
  return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def _add_health(sub: Any) -> None:
  p = sub.add_parser("health", help="exit 0 if a server answers SERVING (for probes)")
  p.add_argument("target", help="HOST:PORT")
  p.add_argument("--service", default="", help="service name (default: the server)")
  p.add_argument("--timeout", type=float, default=5.0, help="seconds (default %(default)g)")
  p.set_defaults(fn=_health)


def _make_dataset(args: argparse.Namespace) -> int:
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  written = demo.write_dataset(pathlib.Path(args.dir), args.source, args.format)
  print(f"wrote {written.config}: dataset {written.dataset!r}")
  return 0


def _add_make_dataset(sub: Any) -> None:
  p = sub.add_parser("make-dataset",
                     help="write the demo dataset and its config into a folder")
  p.add_argument("dir", help="folder to write shards/ and elevator.toml into")
  p.add_argument("--source", choices=("auto", "digits", "generated"), default="auto")
  p.add_argument("--format", choices=("auto", "tfds", "arrayrecord"), default="auto",
                 help="tfds: a TFDS dataset served by name; arrayrecord: shards of the "
                      "example record format with a decode pipeline; auto (default): "
                      "tfds if tensorflow-datasets is installed")
  p.set_defaults(fn=_make_dataset)


def _make_tokenizer(args: argparse.Namespace) -> int:
  from grain_elevator.tools import tokenizer  # pylint: disable=g-import-not-at-top
  try:
    out = tokenizer.train(args.out, args.vocab_size, replace=args.force)
  except ImportError:
    print("elevator: error: make-tokenizer needs the `tokenizers` package: "
          "pip install 'grain-elevator[text]'", file=sys.stderr)
    return 2
  except tokenizer.OutputError as e:
    print(f"elevator: error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}: a byte-level BPE of {args.vocab_size} tokens trained on CPython's "
        "pydoc topics")
  return 0


def _add_make_tokenizer(sub: Any) -> None:
  from grain_elevator.tools import tokenizer  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("make-tokenizer",
                     help="train a byte-level BPE for the text pipelines, locally, from "
                          "text that ships with CPython")
  p.add_argument("out", metavar="OUT",
                 help="the tokenizers JSON file to write (its folder is made if "
                      "missing)")
  p.add_argument("--vocab-size", type=int, default=tokenizer.DEFAULT_VOCAB_SIZE,
                 help="tokens (default %(default)s)")
  p.add_argument("--force", action="store_true", help="replace OUT if it exists")
  p.set_defaults(fn=_make_tokenizer)


def _bench(args: argparse.Namespace) -> int:
  if args.storage == "s3":
    return _bench_storage(args)
  from grain_elevator.tools.bench import run  # pylint: disable=g-import-not-at-top
  report = run.run(
      data_dir=args.data, workload_names=args.workloads.split(","),
      workers=[int(w) for w in args.workers.split(",")], repeats=args.repeats,
      seconds=args.seconds, warmup_s=args.warmup,
      records={"small": args.small_records, "large": args.large_records,
               "image": args.image_records, "text": args.text_records},
      tfdata=not args.no_tfdata, global_batch_size=args.global_batch_size)
  print(run.table(report))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
  if args.plot:
    try:
      run.plot(report, args.plot)
      print(f"wrote {args.plot}")
    except ImportError:
      print("no plot: pip install 'grain-elevator[bench]' for matplotlib", file=sys.stderr)
  return 0


def _bench_storage(args: argparse.Namespace) -> int:
  import tempfile  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.bench import buckets  # pylint: disable=g-import-not-at-top
  names = (args.workloads.split(",") if args.workloads != _BENCH_WORKLOADS
           else list(buckets.WORKLOADS))
  root = pathlib.Path(args.data or os.path.join(tempfile.gettempdir(), "grain-elevator-bench"))
  try:
    ttfb = tuple(float(x) for x in args.storage_ttfb_ms.split(","))
    if len(ttfb) != 2 or not 0 <= ttfb[0] <= ttfb[1] or (ttfb[0] == 0) != (ttfb[1] == 0):
      raise ValueError(f"--storage-ttfb-ms wants P50,P99 with 0 < P50 <= P99 (or 0,0), got "
                       f"{args.storage_ttfb_ms!r}")
    if args.storage_max_rate < 0 or args.pace < 0:
      raise ValueError("--storage-max-rate and --pace must be >= 0")
    settings = buckets.StoreSettings(ttfb_ms=ttfb, max_rate=args.storage_max_rate,
                                     pace=args.pace)
    report = buckets.run(root, names, workers=max(int(w) for w in args.workers.split(",")),
                         repeats=args.repeats, seconds=args.seconds, warmup_s=args.warmup,
                         settings=settings,
                         records={"small": args.small_records, "image": args.image_records,
                                  "text": args.text_records},
                         global_batch_size=args.global_batch_size)
  except ValueError as e:
    print(f"elevator: error: {e}", file=sys.stderr)
    return 2
  for name, wl in report["workloads"].items():
    print("\n".join(buckets.table(name, wl, report["repeats"])))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
  return 0


def _add_bench(sub: Any) -> None:
  from grain_elevator.tools.bench import defaults  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("bench", help="measure against local Grain, tf.data service "
                                   "and the wire's limit")
  p.add_argument("--workloads", default=_BENCH_WORKLOADS,
                 help=f"any of {','.join(defaults.RECORDS)} (default %(default)s); image: "
                      "JPEG decode + random resized crop + flip (needs "
                      "grain-elevator[images]); text: tokenize, chunk and pack documents for "
                      "a language model (needs grain-elevator[text])")
  p.add_argument("--data", default=None,
                 help="folder for the benchmark's shards (default: a temp folder, "
                      "reused across runs)")
  p.add_argument("--workers", default="1,2", help="server worker counts (default %(default)s)")
  p.add_argument("--repeats", type=int, default=3, help="runs per system (default %(default)s)")
  p.add_argument("--seconds", type=float, default=3.0,
                 help="measured seconds per run (default %(default)g)")
  p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run")
  for name, records in defaults.RECORDS.items():  # 0: the workload's own
    p.add_argument(f"--{name}-records", type=int, default=0,
                   help=f"{'documents' if name == 'text' else 'records'} in the {name} "
                        f"workload (default {records:,})")
  p.add_argument("--global-batch-size", type=int, default=0, metavar="G",
                 help="records (text: rows) a step in every workload instead of its own G "
                      "(default: each workload's): a smoke run's smaller steps, whose "
                      "figures are not the benchmark's")
  p.add_argument("--json", default=None, help="also write the full results here")
  p.add_argument("--plot", default=None, help="also draw a PNG here (needs matplotlib)")
  p.add_argument("--no-tfdata", action="store_true",
                 help="skip (e) tf.data service even when TensorFlow is installed")
  in_bucket = defaults.BUCKET_RECORDS
  p.add_argument("--storage", choices=["local", "s3"], default="local",
                 help="s3: read the small, image and text workloads from the stand-in S3 "
                      "store (tools/testing/object_store.py) with --storage-ttfb-ms, by the "
                      "server by plan, with its cache cold and warm, against local Grain's "
                      "per-record reads, whole-shard downloads in a windowed shuffle and "
                      "the same server on local files (tools/bench/buckets.py, "
                      "bucket_text.py; --workers: its largest; default records: "
                      f"{in_bucket['small']:,} small, {in_bucket['image']:,} image, "
                      f"{in_bucket['text']:,} text documents)")
  ttfb = ",".join(f"{x:g}" for x in defaults.BUCKET_TTFB_MS)
  p.add_argument("--storage-ttfb-ms", default=ttfb, metavar="P50,P99",
                 help="with --storage s3: the store's time to first byte, log-normal by its "
                      "median and 99th percentile in ms (default %(default)s; 0,0: none)")
  p.add_argument("--storage-max-rate", type=float, default=0.0, metavar="N",
                 help="with --storage s3: the store refuses past N requests/s per prefix "
                      "(503 SlowDown; default %(default)g: never)")
  p.add_argument("--pace", type=float, default=0.0, metavar="N",
                 help="with --storage s3: a trainer that takes at most N records/s (text: "
                      "rows), working G/N s on each batch (default %(default)g: as fast as it "
                      "can)")
  p.set_defaults(fn=_bench)


def _bench_feed(args: argparse.Namespace) -> int:
  from grain_elevator.tools.bench import defaults  # pylint: disable=g-import-not-at-top
  if args.device:  # the GPU check (tools/bench/device_feed.py)
    from grain_elevator.tools.bench import device_feed  # pylint: disable=g-import-not-at-top
    return device_feed.run_from_args(argparse.Namespace(
        records=args.records or device_feed.RECORDS, steps=args.steps,
        step_ms=defaults.DEVICE_STEP_MS,
        workers=args.workers or device_feed.default_workers(), data=args.data,
        json=args.json))
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.bench import feed, workloads  # pylint: disable=g-import-not-at-top
  from grain_elevator.tools.testing.launcher import LocalServer  # pylint: disable=g-import-not-at-top
  w = workloads.WORKLOADS["small"]
  root = pathlib.Path(args.data or os.path.join(tempfile.gettempdir(), "grain-elevator-bench"))
  config = workloads.prepare(root, w, args.records or w.default_records)
  files = workloads.shard_files(root, w)
  workloads.warm_page_cache(files)
  devices = jax.devices()
  print(f"{len(devices)} {devices[0].platform} devices ({devices[0].device_kind}); small "
        f"workload, G={w.global_batch_size}; {args.steps} steps per run")
  print("| step ms | system | data stall | steps/s | H2D GB/s |")
  print("|---|---|---|---|---|")
  results = []
  with LocalServer(config, workers=args.workers or defaults.FEED_WORKERS) as server:
    for step_ms in [float(x) for x in args.step_ms.split(",")]:
      r = feed.run(server_target=server.target, dataset=w.name, files=files,
                   options=w.options, global_batch_size=w.global_batch_size,
                   steps=args.steps, step_ms=step_ms)
      results.append({"step_ms": step_ms, "systems": r})
      for name, m in r.items():
        stall = f"{m['stall_fraction']:.1%}" if "stall_fraction" in m else ""
        rate = f"{m['steps_per_s']:.1f}" if "steps_per_s" in m else ""
        print(f"| {step_ms:g} | {name} | {stall} | {rate} | {m['h2d_gb_per_s']:.2f} |",
              flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
  return 0


def _add_bench_feed(sub: Any) -> None:
  from grain_elevator.tools.bench import defaults  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("bench-feed",
                     help="data-stall fraction and host->device GB/s of a training loop")
  p.add_argument("--step-ms", default="2,10",
                 help="device step durations to try, ms (default %(default)s)")
  p.add_argument("--steps", type=int, default=200, help="steps per run (default %(default)s)")
  p.add_argument("--workers", type=int, default=0,
                 help=f"server worker processes (default {defaults.FEED_WORKERS}; with "
                      "--device half the cores, 2 to 8)")
  p.add_argument("--data", default=None, help="folder for the shards (as in bench)")
  p.add_argument("--records", type=int, default=0,
                 help=f"records (default {defaults.RECORDS['small']:,}; with --device "
                      f"{defaults.DEVICE_RECORDS:,} large ones)")
  p.add_argument("--json", default=None, help="also write the results here")
  p.add_argument("--device", action="store_true",
                 help="the GPU check instead: host-to-device GB/s through to_device and "
                      "TorchLoader against the page-locked copy, the stall at a "
                      f"{defaults.DEVICE_STEP_MS:g} ms step, bit-exactness "
                      "(tools/bench/device_feed.py; under 4 minutes)")
  p.set_defaults(fn=_bench_feed)


def _bench_tfds(args: argparse.Namespace) -> int:
  from grain_elevator.tools.bench import tfds  # pylint: disable=g-import-not-at-top
  return tfds.run_from_args(args)


def _add_bench_tfds(sub: Any) -> None:
  from grain_elevator.tools.bench import tfds as bench_tfds  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("bench-tfds",
                     help="a TFDS dataset served by name against tfds.data_source under "
                          "local Grain")
  bench_tfds.add_arguments(p)
  p.set_defaults(fn=_bench_tfds)


def _demo(args: argparse.Namespace) -> int:
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  return demo.run(steps=args.steps, workers=args.workers, data_dir=args.data_dir,
                  source=args.source, fmt=args.format)


def _add_demo(sub: Any) -> None:
  from grain_elevator.tools import demo  # pylint: disable=g-import-not-at-top
  run = _keyword_defaults(demo.run)
  p = sub.add_parser("demo", help="write a small dataset, serve it, train on it, resume")
  p.add_argument("--steps", type=int, default=run["steps"],
                 help="training steps (default %(default)s)")
  p.add_argument("--workers", type=int, default=run["workers"], help="server worker processes")
  p.add_argument("--data-dir", default=None,
                 help="where to write the demo dataset (default: a temp folder)")
  p.add_argument("--source", choices=("auto", "digits", "generated"), default=run["source"],
                 help="digits: scikit-learn's bundled images (pip install "
                      "'grain-elevator[demo]'); generated: synthetic; auto: digits "
                      "if scikit-learn is installed")
  p.add_argument("--format", choices=("auto", "tfds", "arrayrecord"), default=run["fmt"],
                 help="tfds: write the images as a TFDS dataset and serve it by name; "
                      "arrayrecord: shards of the example record format; auto "
                      "(default): tfds if tensorflow-datasets is installed")
  p.set_defaults(fn=_demo)


def _demo_lm(args: argparse.Namespace) -> int:
  from grain_elevator.tools import demo_lm  # pylint: disable=g-import-not-at-top
  return demo_lm.run(steps=args.steps, workers=args.workers, data_dir=args.data_dir)


def _add_demo_lm(sub: Any) -> None:
  from grain_elevator.tools import demo_lm  # pylint: disable=g-import-not-at-top
  run = _keyword_defaults(demo_lm.run)
  p = sub.add_parser("demo-lm", help="train a small language model from packed text "
                                     "served by a stream dataset, stop, resume, check")
  p.add_argument("--steps", type=int, default=run["steps"],
                 help="training steps (default %(default)s)")
  p.add_argument("--workers", type=int, default=run["workers"], help="server worker processes")
  p.add_argument("--data-dir", default=None, help="where to write the data (default: temp)")
  p.set_defaults(fn=_demo_lm)


def _demo_torch(args: argparse.Namespace) -> int:
  from grain_elevator.tools import demo_torch  # pylint: disable=g-import-not-at-top
  return demo_torch.run(workers=args.workers, data_dir=args.data_dir)


def _add_demo_torch(sub: Any) -> None:
  from grain_elevator.tools import demo_torch  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("demo-torch", help="train with torch.distributed on 2 processes from "
                                        "the service, save with DCP, resume on 1, check")
  p.add_argument("--workers", type=int, default=_keyword_defaults(demo_torch.run)["workers"],
                 help="server worker processes")
  p.add_argument("--data-dir", default=None, help="where to write the data (default: temp)")
  p.set_defaults(fn=_demo_torch)


def _convert(args: argparse.Namespace) -> int:
  from grain_elevator.tools.convert import cli as convert_cli  # pylint: disable=g-import-not-at-top
  return convert_cli.run(args)


def _add_convert(sub: Any) -> None:
  from grain_elevator.tools.convert import cli as convert_cli  # pylint: disable=g-import-not-at-top
  p = sub.add_parser("convert", help="convert TFRecord, image folders, Parquet or .npz "
                                     "into ArrayRecord shards and print their config")
  convert_cli.add_subcommands(p)
  p.set_defaults(fn=_convert)


# The subcommands, in the order `elevator --help` lists them.
_SUBCOMMANDS = (_add_serve, _add_describe, _add_explain, _add_cursor, _add_top, _add_health,
                _add_make_dataset, _add_make_tokenizer, _add_bench, _add_bench_feed,
                _add_bench_tfds, _add_demo, _add_demo_lm, _add_demo_torch, _add_convert)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="elevator",
      description="grain-elevator: serve deterministic, resumable Grain batches over gRPC.")
  sub = parser.add_subparsers(dest="command", required=True)
  for add in _SUBCOMMANDS:
    add(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  logs.setup()
  try:
    return args.fn(args)
  except ElevatorError as e:
    print(f"elevator: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
