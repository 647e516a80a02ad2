"""What a step held: where each row of a host's slice came from (`elevator explain`).

Every row of a 1:1 dataset or a mixture is a pure function of the config,
G, the step and the host (the contract, proto/contract.py), so its origin is
computed, not logged: the record position in the dataset's stream, its
epoch, the source record behind it (after the shuffle) and the shard and
record index where that is stored; for a mixture also the component and the
position in the component's stream; in evaluation mode, rows past the
stream's end are marked as padding. The JSON this returns is documented in
docs/client.md ("What a step held"); EXPLAIN_VERSION numbers its format.

A stream dataset's rows are made by its pipeline from a position, and a
packer mixes several elements into a row, so a row's origin is traced: the
same pipeline is run a second time from the same position on a head whose
1-D integer leaves (token sequences) are replaced by codes, each naming
its head element and its offset in it (`_tag`). A packer that decides by
lengths alone (first-fit, concat-then-split, chunking) moves the codes
exactly as it moved the tokens, so each row's codes give its segments: the
element, the offset of its first token in it, and how many. Every other leaf
of the traced batch must equal the served one (segment ids, positions, the
mask), else the pipeline decides by values and explaining it is refused.
A segment is what the row's segment ids say (the traced leaf's
`<leaf>_segment_ids`, as Grain's packers name it): two chunks of one
document packed side by side have consecutive codes but two ids, and are
two segments.

Tracing makes a global batch twice, so it is bounded as serving one is:
at most MAX_STREAM_SUMMARY_ROWS rows of G (proto/limits.py) and a `check`
(the request's cancellation, server/data/streams/cancellation.py) before
each traced element; counting a summary of a step dataset checks it per
chunk of _CHUNK positions. A request that goes away stops within one
element or chunk.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Iterator

import numpy as np

from grain_elevator.proto import contract
from grain_elevator.proto import tree
from grain_elevator.proto.errors import EndOfDataError, InvalidRequestError
from grain_elevator.proto import limits
from grain_elevator.proto.limits import MAX_EXPLAIN_ROWS, MAX_SUMMARY_ROWS

EXPLAIN_VERSION = 1
# Positions located per numpy call while counting: bounds a summary's memory,
# and the time between its checks (~25 ms measured for a mixture on a loaded
# 2-core machine; 2**20 took ~73 ms, 2**28 rows ~19 s).
_CHUNK = 1 << 18
# A traced token's code: (element index) * _STRIDE + (offset in it) + 1; 0 is padding.
_STRIDE = 1 << 32
# The packers' name for a leaf's segment ids (Grain's FirstFit and ConcatThenSplit).
_SEGMENT_IDS = "_segment_ids"

Check = Callable[[], None]


def _always() -> None:
  """The `check` of work no request waits for: it never stops."""


def explain(ds: Any, step: int, global_batch_size: int, shard_index: int, shard_count: int,
            record_offset: int = 0) -> dict[str, Any]:
  """The rows of host h of H's slice of global batch `step`, each with its
  origin (a JSON-safe dict). `ds`: an ElevatorDataset or a MixtureDataset,
  the steps already validated by the request path."""
  info = ds.info
  rows = global_batch_size // shard_count
  if rows > MAX_EXPLAIN_ROWS:
    raise InvalidRequestError(
        f"dataset {info.name!r}: a host slice of {rows} rows is more than one explanation "
        f"holds ({MAX_EXPLAIN_ROWS}, MAX_EXPLAIN_ROWS); explain it in parts with more hosts "
        f"(--hosts {-(-global_batch_size // MAX_EXPLAIN_ROWS)} or more, each a --host)")
  positions = contract.host_positions(step, global_batch_size, shard_index, shard_count,
                                      record_offset)
  first_row = contract.host_rows(global_batch_size, shard_index, shard_count).start
  real = [p for p in positions if p < info.stream_length]
  components = getattr(ds, "components", None)
  origins = (mixture_origins(ds, real, global_batch_size) if components is not None
             else ds.origins(real))
  out_rows: list[dict[str, Any]] = []
  for i, p in enumerate(positions):
    row: dict[str, Any] = {"row": i, "global_row": first_row + i}
    if i < len(origins):
      row.update(origins[i])
    else:  # evaluation mode: past the stream's end, a zero row masked out
      row.update({"position": p, "padding": True})
    out_rows.append(row)
  return {
      "version": EXPLAIN_VERSION, "dataset": info.name,
      "config_fingerprint": info.config_fingerprint, "kind": (
          "mixture" if components is not None else "records"),
      "step": step, "global_batch_size": global_batch_size, "shard_index": shard_index,
      "shard_count": shard_count, "record_offset": record_offset, "rows": out_rows}


def mixture_origins(ds: Any, positions: list[int], global_batch_size: int
                    ) -> list[dict[str, Any]]:
  """Each mixture position's component, its position in the component's
  stream, and that record's origin there."""
  if not positions:
    return []
  component, index = ds.locate(np.asarray(positions, np.int64), global_batch_size)
  out: list[dict[str, Any]] = [{} for _ in positions]
  for j, name in enumerate(ds.names):
    where = np.flatnonzero(component == j)
    if not len(where):
      continue
    for i, origin in zip(where.tolist(), ds.components[j].origins(index[where].tolist())):
      q = origin.pop("position")
      out[i] = {"position": positions[i], "component": name, "component_position": q,
                **origin}
  return out


def explain_stream(ds: Any, global_batch_size: int, shard_index: int, shard_count: int,
                   step: int, position: str, check: Check = _always, *,
                   stream_shard: int = 0, stream_shards: int = 1) -> dict[str, Any]:
  """Host h's rows of a stream dataset's global batch `step`, which starts
  at `position`: each row's segments (module docstring). `ds`: a
  StreamDataset; `check` raises once the request is no longer wanted.

  A stream of N > 1 sub-streams (server/data/streams/sub_streams.py): `ds`
  is sub-stream `stream_shard`, and the rows are host h's of its sub-batch
  `step` (contract.sub_stream_rows, maybe none), numbered as in the host
  slice ("row") and the global batch ("global_row"), each naming its
  sub-stream. In evaluation mode a sub-stream that has ended gives padding
  rows (`stream_ended`): the global batch goes on while any has a batch."""
  info = ds.info
  g = global_batch_size
  host = contract.host_rows(g, shard_index, shard_count)
  if len(host) > MAX_EXPLAIN_ROWS:
    raise InvalidRequestError(
        f"dataset {info.name!r}: a host slice of {len(host)} rows is more than one "
        f"explanation holds ({MAX_EXPLAIN_ROWS}); explain it in parts with more hosts")
  several = stream_shards > 1
  part = g // stream_shards  # the rows of each traced batch: G, or a sub-batch's G/N
  first = stream_shard * part  # its first row in the global batch
  rows = (contract.sub_stream_rows(g, shard_index, shard_count, stream_shard, stream_shards)
          if several else host)
  traced = next(_traced_steps(ds, part, position, check), None)
  ended = traced is None
  if ended and (not several or info.drop_remainder):
    which = f"sub-stream {stream_shard} of {stream_shards}" if several else "the stream"
    raise InvalidRequestError(f"dataset {info.name!r}: {which} ends before step {step}")
  leaf, _, codes, mask, ids = traced if traced is not None else (None, None, None, None, None)
  out_rows = []
  for r in rows:
    row: dict[str, Any] = {"row": first + r - host.start, "global_row": first + r}
    if several:
      row["stream_shard"] = stream_shard
    if ended or (mask is not None and not mask[r]):
      row["padding"] = True
    else:
      row["segments"] = _segments(codes[r], None if ids is None else ids[r])
    out_rows.append(row)
  if _elements_are_records(ds) and ds.origins is not None:
    elements = sorted({s["element"] for row in out_rows for s in row.get("segments", ())})
    found = dict(zip(elements, ds.origins(elements)))
    for row in out_rows:
      for s in row.get("segments", ()):
        s.update(found[s["element"]])
  shards = ({"stream_shard": stream_shard, "stream_shards": stream_shards,
             "stream_ended": ended} if several else {})
  return {
      "version": EXPLAIN_VERSION, "dataset": info.name,
      "config_fingerprint": info.config_fingerprint, "kind": "stream", "step": step,
      "global_batch_size": g, "shard_index": shard_index, "shard_count": shard_count,
      **shards, "stream_state": position, "traced_leaf": leaf, "rows": out_rows}


def summary_stream(ds: Any, start: int, num_steps: int, global_batch_size: int,
                   position: str, check: Check = _always, *,
                   stream_shard: int = 0, stream_shards: int = 1) -> dict[str, Any]:
  """Tokens, segments and documents per source in a stream dataset's whole
  global batches [start, start + num_steps), which begin at `position`:
  each step traced as `explain_stream` traces one, counted with numpy. A
  document counts where its first token is; a segment is one of a row's
  segments as `explain_stream` lists them (one segment id's run). Sources are the mixture's components where
  the stream's elements are the mixture's records (the pipeline keeps its
  length), else the dataset. At most MAX_STREAM_SUMMARY_ROWS rows a call;
  `next_stream_state` is where the next call goes on.

  A stream of N > 1 sub-streams: `ds` is sub-stream `stream_shard`, whose
  sub-batches (G/N rows) are counted; in evaluation mode, once it has
  ended, its sub-batches count as padding, and `steps_made` says how many
  it made (the global range passes the end if no sub-stream made them all)."""
  info = ds.info
  several = stream_shards > 1
  g = global_batch_size // stream_shards  # the rows traced a step: G, or G/N
  if num_steps > limits.stream_summary_steps(g):
    raise InvalidRequestError(
        f"dataset {info.name!r}: a stream summary traces every row, at most "
        f"{limits.MAX_STREAM_SUMMARY_ROWS} a call (MAX_STREAM_SUMMARY_ROWS, or one step); "
        f"{num_steps} steps of {g} are {num_steps * g}: split the range "
        "(RemoteDataset.summary does)")
  names = (tuple(ds.component_names)
           if ds.component_of is not None and _elements_are_records(ds) else (info.name,))
  tokens, segments, documents = (np.zeros(len(names), np.int64) for _ in range(3))
  rows = padding = done = 0
  after = position
  for _, after, codes, mask, ids in itertools.islice(_traced_steps(ds, g, position, check),
                                                      num_steps):
    done += 1
    keep = slice(None) if mask is None else np.asarray(mask, bool)
    real = codes[keep]
    padding += g - len(real)
    rows += len(real)
    before = _left(real)
    used = real != 0
    starts = (before == 0) | (real != before + 1)
    if ids is not None:  # a new segment id starts a segment, whatever the codes
      served_ids = ids[keep]
      starts |= served_ids != _left(served_ids)
    starts = starts[used]  # of the used slots
    codes_used = real[used]
    element = (codes_used - 1) // _STRIDE
    first = (codes_used - 1) % _STRIDE == 0
    if len(names) > 1:
      unique, inverse = np.unique(element, return_inverse=True)
      source = np.asarray(ds.component_of(unique), np.int64)[inverse]
    else:
      source = np.zeros(len(element), np.int64)
    tokens += np.bincount(source, minlength=len(names))
    segments += np.bincount(source[starts], minlength=len(names))
    documents += np.bincount(source[first], minlength=len(names))
  if done < num_steps and several and not info.drop_remainder:
    padding += (num_steps - done) * g  # evaluation mode: an ended sub-stream's padding
  elif done < num_steps:
    which = f"sub-stream {stream_shard} of {stream_shards}" if several else "the stream"
    raise EndOfDataError(
        f"dataset {info.name!r}: a summary of steps [{start}, {start + num_steps}) passes the "
        f"end of {which}, which ends after step {start + done - 1}")
  total = int(tokens.sum())
  shards = ({"stream_shard": stream_shard, "stream_shards": stream_shards,
             "steps_made": done} if several else {})
  return {
      "version": EXPLAIN_VERSION, "dataset": info.name,
      "config_fingerprint": info.config_fingerprint, "kind": "stream",
      "steps": [start, start + num_steps], "global_batch_size": global_batch_size,
      **shards, "stream_state": position, "next_stream_state": after, "rows": rows,
      "padding_rows": padding, "tokens": total,
      "components": {name: {"tokens": int(t), "segments": int(n), "documents": int(d),
                            "share": int(t) / total if total else 0.0}
                     for name, t, n, d in zip(names, tokens, segments, documents)}}


def _left(a: np.ndarray) -> np.ndarray:
  """Each slot's left neighbour in its row, 0 for the first slot."""
  return np.pad(a[:, :-1], ((0, 0), (1, 0)))


def _traced_steps(ds: Any, global_batch_size: int, position: str, check: Check
                  ) -> Iterator[tuple[str, str, np.ndarray, np.ndarray | None,
                                      np.ndarray | None]]:
  """A stream's global batches from `position`, each made twice, served and
  traced (module docstring): (the traced leaf, the position after the
  batch, its codes, the served mask or None, the served segment ids of the
  traced leaf or None). At most MAX_STREAM_SUMMARY_ROWS rows of G. The
  served pipeline's head checks cancellation
  (server/data/streams/cancellation.py), the traced one `check`."""
  info = ds.info
  g = global_batch_size
  if g > limits.MAX_STREAM_SUMMARY_ROWS:
    raise InvalidRequestError(
        f"dataset {info.name!r}: explain and summary trace a stream's whole global batch, "
        f"made twice, of at most {limits.MAX_STREAM_SUMMARY_ROWS} rows "
        f"(MAX_STREAM_SUMMARY_ROWS); G={g} is more")

  def tagged_head(head: Any) -> Any:
    def tag(index: int, element: Any) -> Any:
      check()
      return _tag(index, element)
    return head.map_with_index(tag).to_iter_dataset()

  served_it = ds.open(g, position)
  traced_it = iter(ds.pipeline(g, head=tagged_head))
  if position:
    from grain_elevator.server.data import grain_private  # pylint: disable=g-import-not-at-top
    traced_it.set_state(grain_private.state_from_json(json.loads(position)))
  tagged: list[str] | None = None
  while (served := ds.next_batch(served_it, g)) is not None:
    traced, _, paths = tree.flatten(next(traced_it))
    if tagged is None:
      tagged = _tagged_paths(ds.head, paths)
      if not tagged:
        raise InvalidRequestError(
            f"dataset {info.name!r}: explain traces token sequences (1-D integer leaves) "
            "through a stream's pipeline, and this one's elements have none")
    for path, real, got in zip(paths, served[0], traced):
      if path not in tagged and not np.array_equal(np.asarray(got), real):
        raise InvalidRequestError(
            f"dataset {info.name!r}: its pipeline cannot be traced: leaf {path!r} differs "
            "when its tokens are replaced by codes (it decides by token values, not lengths)")
    mask = (np.asarray(served[0][paths.index(contract.MASK_KEY)])
            if contract.MASK_KEY in paths else None)
    ids_path = tagged[0] + _SEGMENT_IDS
    ids = np.asarray(served[0][paths.index(ids_path)]) if ids_path in paths else None
    yield tagged[0], served[1], np.asarray(traced[paths.index(tagged[0])]), mask, ids


def _elements_are_records(ds: Any) -> bool:
  """Whether head element i is record position i (the pipeline keeps the
  length: maps, filters' holes), so an element has a record's origin."""
  return len(ds.head) == len(ds.records)


def _tag(index: int, element: Any) -> Any:
  """`element` with each 1-D integer leaf replaced by its codes."""
  leaves, structure, _ = tree.flatten(element)
  out = []
  for leaf in leaves:
    a = np.asarray(leaf)
    if a.ndim == 1 and a.dtype.kind in "iu":
      a = np.int64(index) * _STRIDE + np.arange(1, len(a) + 1, dtype=np.int64)
    out.append(a)
  return tree.unflatten(structure, out)


def _tagged_paths(head: Any, batch_paths: list[str]) -> list[str]:
  """The batch's leaves that carry codes: those named as a head element's
  1-D integer leaves."""
  for i in range(min(len(head), 64)):
    element = head[i]
    if element is not None:
      leaves, _, paths = tree.flatten(element)
      names = {p for p, l in zip(paths, leaves)
               if np.asarray(l).ndim == 1 and np.asarray(l).dtype.kind in "iu"}
      return [p for p in batch_paths if p in names]
  return []


def _segments(codes: np.ndarray, ids: np.ndarray | None) -> list[dict[str, Any]]:
  """A traced row's segments: runs of consecutive tokens of one element
  under one segment id (`ids`, the row's served segment ids; None: the
  codes alone): where each starts in the row (slot), the element, the
  offset in it, the length."""
  out: list[dict[str, Any]] = []
  id_of = ids.tolist() if ids is not None else [0] * len(codes)
  last_id = None
  for slot, code in enumerate(codes.tolist()):
    if code == 0:
      continue
    element, offset = divmod(code - 1, _STRIDE)
    last = out[-1] if out else None
    if (last is not None and last["element"] == element and last_id == id_of[slot]
        and last["slot"] + last["length"] == slot
        and last["token_offset"] + last["length"] == offset):
      last["length"] += 1
    else:
      out.append({"slot": slot, "element": element, "token_offset": offset, "length": 1})
    last_id = id_of[slot]
  return out


def counts(ds: Any, first: int, stop: int, global_batch_size: int,
           check: Check = _always) -> dict[str, int]:
  """Records at stream positions [first, stop) of a 1:1 dataset or mixture,
  by component ("" for a dataset that is not a mixture), and "" past the
  stream's end counted as padding ("_padding"), in chunks of _CHUNK, with
  `check` before each."""
  info = ds.info
  out: dict[str, int] = {}
  real_stop = min(stop, max(first, info.stream_length))
  if stop > real_stop:
    out["_padding"] = stop - real_stop
  components = getattr(ds, "components", None)
  if components is None:
    if real_stop > first:
      out[""] = real_stop - first
    return out
  for start in range(first, real_stop, _CHUNK):
    check()
    which, _ = ds.locate(np.arange(start, min(real_stop, start + _CHUNK), dtype=np.int64),
                         global_batch_size)
    for j, n in enumerate(np.bincount(which, minlength=len(ds.names)).tolist()):
      if n:
        out[ds.names[j]] = out.get(ds.names[j], 0) + n
  return out


def summary(ds: Any, start: int, num_steps: int, global_batch_size: int,
            record_offset: int = 0, check: Check = _always) -> dict[str, Any]:
  """Records per mixture component in whole global batches [start, start +
  num_steps): computed from the contract, not logged; `check` raises once
  the request is no longer wanted (counts)."""
  info = ds.info
  rows = num_steps * global_batch_size
  if rows > MAX_SUMMARY_ROWS:
    raise InvalidRequestError(
        f"dataset {info.name!r}: a summary of {num_steps} steps of {global_batch_size} is "
        f"{rows} records, over the {MAX_SUMMARY_ROWS} one summary computes "
        "(MAX_SUMMARY_ROWS); split the range")
  first = record_offset + start * global_batch_size
  found = counts(ds, first, first + rows, global_batch_size, check)
  padding = found.pop("_padding", 0)
  total = sum(found.values())
  return {
      "version": EXPLAIN_VERSION, "dataset": info.name,
      "config_fingerprint": info.config_fingerprint,
      "kind": "mixture" if getattr(ds, "components", None) is not None else "records",
      "steps": [start, start + num_steps], "global_batch_size": global_batch_size,
      "record_offset": record_offset, "records": total, "padding_rows": padding,
      "components": {name or info.name: {"records": n, "share": n / total if total else 0.0}
                     for name, n in sorted(found.items())}}
