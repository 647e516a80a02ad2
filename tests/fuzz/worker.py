"""One reading process of the fuzzer (tests/fuzz/fuzz_reader.py).

    python worker.py ours [MODULE]   # server/data/shards/reader.py, with MODULE as its C part
    python worker.py arrayrecord     # ArrayRecord's own reader: the oracle

Reads one job a line on stdin ({"path", "seed"}), answers one JSON line on
stdout: how opening went, the record count, and per read the records'
digests or the error. A separate process so that a sanitizer report, a
crash or a hang costs one input, not the run; and so that the oracle's
crashes are not mistaken for ours.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import resource
import sys
import time
from typing import Any

# Reads per input: each of the first and last records alone, then all of
# them, then random batches (repeats and any order), as the server asks.
FIRST, LAST, ALL, BATCHES = 48, 16, 256, 4


def plans(n: int, seed: int) -> list[list[int]]:
  """The reads to make of a shard of `n` records (the same for both readers)."""
  singles = sorted(set(range(min(n, FIRST))) | set(range(max(0, n - LAST), n)))
  out = [[i] for i in singles]
  if n:
    rng = random.Random(seed)
    out.append(list(range(min(n, ALL))))
    for _ in range(BATCHES):
      out.append([rng.randrange(n) for _ in range(rng.randint(1, 12))])
  return out


def digest(record: Any) -> str:
  if type(record) is not bytes:
    return f"not bytes: {type(record).__name__}"
  return hashlib.blake2b(record, digest_size=12).hexdigest()


def describe(e: BaseException) -> str:
  return f"{type(e).__module__}.{type(e).__qualname__}: {str(e)[:500]}"


def _load_ours(module_path: str | None):
  """shard_reader, with its C part loaded from `module_path` if given."""
  if module_path:
    spec = importlib.util.spec_from_file_location("grain_elevator.server.data.shards._riegeli", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["grain_elevator.server.data.shards._riegeli"] = module
    import grain_elevator.server.data.shards as package  # pylint: disable=g-import-not-at-top
    package._riegeli = module  # type: ignore[attr-defined]
  from grain_elevator.server.data.shards import reader as shard_reader  # pylint: disable=g-import-not-at-top
  if module_path:
    assert shard_reader.chunks.riegeli.__file__ == module_path, shard_reader.chunks.riegeli.__file__
  return shard_reader


def run_ours(shard_reader: Any, path: str, seed: int) -> dict:
  out: dict[str, Any] = {"reads": []}
  try:
    reader = shard_reader.ShardReader(path)
  except shard_reader.CorruptShard as e:
    return {"open": "corrupt", "message": str(e)}
  except shard_reader.UnsupportedShard as e:
    return {"open": "unsupported", "message": str(e)}
  except Exception as e:  # pylint: disable=broad-except
    return {"open": "error", "message": describe(e)}
  out["open"] = "ok"
  out["n"] = n = reader.num_records
  for indices in plans(n, seed):
    try:
      got = reader.read(indices)
      if len(got) != len(indices):
        out["reads"].append({"idx": indices, "error": f"{len(got)} records for {len(indices)}"})
      else:
        out["reads"].append({"idx": indices, "ok": [digest(r) for r in got]})
    except shard_reader.CorruptShard as e:
      out["reads"].append({"idx": indices, "corrupt": str(e)})
    except shard_reader.UnsupportedShard as e:
      out["reads"].append({"idx": indices, "unsupported": str(e)})
    except Exception as e:  # pylint: disable=broad-except
      out["reads"].append({"idx": indices, "error": describe(e)})
  reader.close()
  return out


def run_arrayrecord(reader_cls: Any, path: str, seed: int) -> dict:
  options = "readahead_buffer_size:0,max_parallelism:0"
  try:
    reader = reader_cls(path, options)
    n = reader.num_records()
  except Exception as e:  # pylint: disable=broad-except
    return {"open": "error", "message": describe(e)}
  if not reader.ok():  # a failed open can read as an empty shard
    return {"open": "error", "message": "reader not ok after opening"}
  records: dict[int, str] = {}
  errors: dict[int, str] = {}
  for i in sorted({i for p in plans(n, seed) for i in p}):
    try:
      records[i] = digest(reader.read([i])[0])
    except Exception as e:  # pylint: disable=broad-except
      errors[i] = describe(e)
      reader = reader_cls(path, options)  # a failed read may leave it failed
  return {"open": "ok", "n": n, "records": records, "errors": errors}


def main() -> None:
  mode = sys.argv[1]
  if mode == "ours":
    shard_reader = _load_ours(sys.argv[2] if len(sys.argv) > 2 else None)
    run = lambda path, seed: run_ours(shard_reader, path, seed)
    with open("/proc/self/maps") as maps:
      sanitized = "libasan" in maps.read()
    hello = {"ready": mode, "module": shard_reader.chunks.riegeli.__file__, "asan": sanitized}
  else:
    # ArrayRecord sizes buffers from the file: cap its memory, so that a
    # crafted size ends it (a refusal) instead of the machine.
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
    run = lambda path, seed: run_arrayrecord(ArrayRecordReader, path, seed)
    hello = {"ready": mode}
  print(json.dumps(hello), flush=True)
  for line in sys.stdin:
    job = json.loads(line)
    start = time.perf_counter()
    result = run(job["path"], job["seed"])
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
