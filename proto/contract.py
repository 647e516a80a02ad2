"""The contract: which records a host receives for a step (docs/concepts.md).

The one home of that mapping; the server, embedded mode and the client's
device feeding all call it, so they cannot disagree:

    global batch k = records[R + k*G : R + (k+1)*G]  (the final partial batch is dropped)
    host h of H    = rows [h*G/H, (h+1)*G/H) of global batch k

R, the record offset, is 0 unless a job changed its global batch size at a
checkpoint: then R is the record it had reached (step k under G0: R = k*G0)
and steps count afresh from there under the new G.

Evaluation mode (a dataset with drop_remainder = false) keeps the final
partial batch: it is padded with zero rows to G, and every batch carries a
bool leaf "_mask", True for the rows that are records (MASK_KEY).

Nothing else (replicas, worker processes, timing, retries) enters. What
defines `records` itself is written down once too: `stream_fingerprint`
hashes it, and a cursor or request for another stream is refused.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Mapping

from grain_elevator.proto.errors import EndOfDataError, InvalidRequestError

MAX_SHARD_COUNT = 1 << 20
# The leaf evaluation mode adds to every batch: True for real rows, False for padding.
MASK_KEY = "_mask"
# Length Grain gives a stream that repeats forever (`repeat(None)`).
FOREVER_LENGTH = sys.maxsize
# The largest record position a request can name (int64 on the wire).
MAX_RECORD_POSITION = (1 << 63) - 1


def check_geometry(global_batch_size: int, shard_index: int, shard_count: int) -> None:
  """Raises InvalidRequestError unless (G, h, H) describe a valid host slice."""
  g, h, n = global_batch_size, shard_index, shard_count
  if g < 1:
    raise InvalidRequestError(f"global_batch_size must be >= 1, got {g}")
  if not 1 <= n <= MAX_SHARD_COUNT:
    raise InvalidRequestError(
        f"shard_count must be in [1, {MAX_SHARD_COUNT}], got {n}")
  if g % n:
    raise InvalidRequestError(
        f"global_batch_size {g} is not divisible by shard_count {n}; each host "
        "must get the same number of rows")
  if not 0 <= h < n:
    raise InvalidRequestError(
        f"shard_index must be in [0, {n}) for shard_count {n}, got {h}")


def host_rows(global_batch_size: int, shard_index: int, shard_count: int) -> range:
  """Rows of each global batch that host h of H receives."""
  rows = global_batch_size // shard_count
  return range(shard_index * rows, (shard_index + 1) * rows)


def sub_stream_rows(global_batch_size: int, shard_index: int, shard_count: int,
                    stream_shard: int, stream_shards: int) -> range:
  """Rows of sub-batch k of sub-stream j that host h receives (possibly
  none), in the sub-batch's own numbering: global batch k of a stream of N
  sub-streams is their N sub-batches k, G/N rows each, one after another,
  and host h takes its rows [h*G/H, (h+1)*G/H) of that, as of any batch."""
  host = host_rows(global_batch_size, shard_index, shard_count)
  rows = global_batch_size // stream_shards
  first = stream_shard * rows
  start, stop = max(host.start, first), min(host.stop, first + rows)
  return range(start - first, max(start, stop) - first)


def check_stream_shards(global_batch_size: int, stream_shards: int, dataset: str) -> None:
  """Raises InvalidRequestError unless G splits into N sub-batches: a
  stream of N sub-streams takes G/N rows a step from each."""
  if stream_shards > 1 and global_batch_size % stream_shards:
    raise InvalidRequestError(
        f"dataset {dataset!r} has {stream_shards} sub-streams (stream_shards), each "
        f"giving G/{stream_shards} rows a step: global_batch_size must be a multiple of "
        f"{stream_shards}, got {global_batch_size}")


def host_positions(step: int, global_batch_size: int, shard_index: int,
                   shard_count: int, record_offset: int = 0) -> range:
  """Record positions of host h's rows of global batch `step`."""
  rows = host_rows(global_batch_size, shard_index, shard_count)
  first = record_offset + step * global_batch_size
  return range(first + rows.start, first + rows.stop)


def steps_per_epoch(num_records: int, global_batch_size: int) -> int:
  """Whole global batches in one epoch of `num_records`."""
  return num_records // global_batch_size


def total_steps(stream_length: int, global_batch_size: int, record_offset: int = 0,
                drop_remainder: bool = True) -> int:
  """Global batches in a stream from `record_offset` on: whole ones (the
  final partial batch dropped), or with `drop_remainder=False` every one,
  the last padded."""
  records = max(0, stream_length - record_offset)
  if drop_remainder:
    return records // global_batch_size
  return -(-records // global_batch_size)


def check_steps(start_step: int, num_steps: int, stream_length: int,
                global_batch_size: int, record_offset: int = 0,
                drop_remainder: bool = True) -> None:
  """Raises unless steps [start, start+num) all exist in the stream."""
  if start_step < 0:
    raise InvalidRequestError(f"start_step must be >= 0, got {start_step}")
  if num_steps < 1:
    raise InvalidRequestError(f"num_steps must be >= 1, got {num_steps}")
  if not 0 <= record_offset <= stream_length:
    raise InvalidRequestError(f"record_offset must be in [0, {stream_length}] (the "
                              f"stream's records), got {record_offset}")
  end = total_steps(stream_length, global_batch_size, record_offset, drop_remainder)
  if start_step + num_steps > end:
    after = f" after record {record_offset}" if record_offset else ""
    last = ("the final partial batch is dropped" if drop_remainder
            else "the last one padded")
    raise EndOfDataError(
        f"steps [{start_step}, {start_step + num_steps}) reach past the end: the "
        f"stream has {end} steps of global batch size {global_batch_size}{after} "
        f"({last})")


def check_skip(step: int, num_steps: Any, global_batch_size: int, record_offset: int = 0,
               total: int | None = None, dataset: str = "") -> None:
  """Raises InvalidRequestError unless skipping `num_steps` global batches
  from `step` lands on a step that exists: a whole number >= 0, whose
  record position fits int64 (the wire's), at most `total` (the steps of a
  finite dataset, None for one that repeats forever or is a stream)."""
  name = f"dataset {dataset!r}: " if dataset else ""
  if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0:
    raise InvalidRequestError(f"{name}a skip must be a whole number of steps >= 0, "
                              f"got {num_steps!r}")
  end = step + num_steps
  if record_offset + end * global_batch_size > MAX_RECORD_POSITION:
    raise InvalidRequestError(
        f"{name}a skip of {num_steps} steps from step {step} reaches step {end}, whose "
        f"records (G={global_batch_size}) lie past 2**63 - 1, the wire's largest position")
  if total is not None and end > total:
    raise InvalidRequestError(
        f"{name}a skip of {num_steps} steps from step {step} passes the end: the dataset "
        f"has {total} steps of global batch size {global_batch_size}"
        + (f" after record {record_offset}" if record_offset else "")
        + f", so at most {max(0, total - step)} can be skipped from there")


def stream_fingerprint(definition: Mapping[str, Any]) -> str:
  """A short, stable hash of everything that defines a record stream (files,
  pipeline and its options, seed, shuffle, epochs): equal only for streams
  that yield the same records."""
  text = json.dumps(definition, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def position_text(state: Any) -> str:
  """A stream dataset's position (its Grain iterator's state) as the JSON
  that travels and is saved: sorted keys, no spaces, so that one position is
  one string on every host, and numpy scalars as plain numbers."""
  return json.dumps(state, sort_keys=True, separators=(",", ":"), default=_plain_number)


def _plain_number(value: Any) -> Any:
  if hasattr(value, "item") and hasattr(value, "dtype"):  # a numpy scalar
    return value.item()
  raise TypeError(f"a stream position holds a {type(value).__name__}, which is not JSON")
