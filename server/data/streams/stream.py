"""A stream dataset: a pipeline that is not 1:1 (filter, flat_map, packing,
a batch_fn), served exactly as Grain's own single process would give it.

The contract (docs/concepts.md, "Stream datasets"): with `records` the
dataset's record stream (its source, seed, shuffle and repeat; or the records
of a mixture of fixed weights), global batch k is the k-th element of

    iter_pipeline(pipeline(records).to_iter_dataset(), **iter_options)
        .batch(G, drop_remainder, batch_fn)

and host h of H gets rows [h*G/H, (h+1)*G/H) of every leaf. It depends on
the config and G alone: never on H, replicas, workers, timing or failures.

Grain cannot find batch k in O(1) past a filter or a packer: by design its
iterator is positioned by a state (an upstream position and a few counters,
JSON), and restoring one replays at most one packing window. A position is
therefore what travels: a request names the state where its first step
starts, each batch goes out with the state after it, and any worker of any
replica continues from either. `batch` passes its parent's state through,
so a position does not depend on G: a new G continues from a saved one.

Evaluation mode (drop_remainder = false) keeps its meaning: the final
partial batch is padded with zero rows to G and every batch carries the bool
leaf "_mask" (True for the rows that are elements). Row shapes must be fixed
(pack or pad to a fixed length): every batch is checked against the spec
found at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from typing import Any, Callable, Iterator, Mapping

import grain
import numpy as np

from grain_elevator import pipelines

from grain_elevator.proto import contract
from grain_elevator.proto import positions
from grain_elevator.proto import tree
from grain_elevator.proto.errors import ConfigError, InvalidRequestError, ShardChangedError
from grain_elevator.proto.limits import MAX_STREAM_STATE_BYTES
from grain_elevator.proto.spec import DatasetInfo, ElementSpec
from grain_elevator.server.data import grain_private
from grain_elevator.server.data.config import DatasetConfig
from grain_elevator.server.data.streams import cancellation
from grain_elevator.server.data.streams import head_reads
from grain_elevator.server.data.streams import object_bytes

# Head: the random-access part, pipeline(records), as an IterDataset.
HeadFactory = Callable[[grain.MapDataset], grain.IterDataset]
# What a produced global batch is: its leaves (G rows each) and the position after it.
GlobalBatch = tuple[list[np.ndarray], str]
# Head elements computed to measure the memory of one (`iterator_bytes`).
_MEASURED_ELEMENTS = 8


dumps = contract.position_text


def parse_position(text: str, start: str, dataset: str) -> str:
  """A position a client sent, checked by shape against the stream's first
  (proto/positions.py), as canonical text; InvalidRequestError otherwise."""
  if text == start:  # the server's own
    return start
  try:
    return dumps(positions.parse(text, start))
  except positions.BadPosition as e:
    raise InvalidRequestError(
        f"dataset {dataset!r}: stream_state is not a position of this stream: {e}") from None


@dataclasses.dataclass(frozen=True)
class StreamRecords:
  """The records a stream dataset reads, and what is known of them: what
  its constructor needs whole (server/data/registry/factory.py opens them)."""

  # Its record stream: its source's records, seeded, shuffled and repeated,
  # or a mixture's of fixed weights, as Grain mixes them.
  records: grain.MapDataset
  num_records: int  # its source's records per epoch (Describe's num_records)
  fingerprint: str  # the stream's: its records' and every stream key
  # Its shards' identities as recorded at start-up (none of its own for a
  # mixture's records: the mixture's components hold theirs).
  identities: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Record stream position -> where it is stored (server/data/provenance.py);
  # None if nobody can say.
  origins: Callable[[list[int]], list[dict[str, Any]]] | None = None
  # A stream over a mixture: the components' names, and the component of
  # each record position (an int array in, indices into component_names
  # out), for per-source counts.
  component_names: tuple[str, ...] = ()
  component_of: Callable[[np.ndarray], np.ndarray] | None = None
  # Records in a bucket: the chunk extents the records at these positions
  # need, which the head reads by plan (head_reads.py); None for local shards.
  needs: Callable[[list[int]], Any] | None = None


class StreamDataset:
  """A registered stream dataset: its info, and its global batches from any
  position. Thread-safe: every call builds its own Grain iterator."""

  def __init__(self, config: DatasetConfig, records: StreamRecords, head: grain.MapDataset,
               *, check_files: Callable[[], None] | None = None):
    """`head`: the config's pipeline over `records.records`. `check_files`:
    run before each build of the iter_pipeline, which may read its
    iter_options' files again (server/data/shards/option_files.py)."""
    self.config = config
    self._check_files = check_files
    self.records = records.records
    self.head = head  # pipeline(records): a MapDataset that may hold None holes
    self._iter_fn = config.iter_pipeline_fn()
    self._user_batch_fn = config.batch_fn_fn()
    # Served in one worker: no read threads (the same elements; on a busy
    # worker, threads only cost).
    self._head_factory: HeadFactory = lambda ds: ds.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    self._head_elements_held = 0
    first, start = self._first_batch()
    self._spec = ElementSpec.of(first)  # of one row
    self._leaves = self._spec.leaves
    self._iterator_base_bytes, self._element_bytes = self._measure_iterator()
    self.info = DatasetInfo(
        name=config.name, num_records=records.num_records, num_epochs=config.num_epochs,
        shuffle=config.shuffle, seed=config.seed, config_fingerprint=records.fingerprint,
        element_spec=self._spec, stream_length=contract.FOREVER_LENGTH,
        drop_remainder=config.drop_remainder, stream=True, stream_start=start)
    # What is known of its records (StreamRecords): their shards, where each
    # came from, their sources. Kept after the measure above, which walks
    # what the dataset holds, as it did when these were set from outside.
    self.identities = records.identities
    self.origins = records.origins
    self.component_names = records.component_names
    self.component_of = records.component_of
    # Its records' reads from a bucket, planned; None for local shards.
    self.head_reads: head_reads.HeadReads | None = None
    if records.needs is not None:
      self._read_by_plan(records.needs)

  def _read_by_plan(self, record_needs: Callable[[list[int]], Any]) -> None:
    """Its records are in a bucket: `record_needs(positions)` names the
    chunk extents the records at these positions need, and the head reads
    them by plan, a block ahead (head_reads.py), until `use_head` gives it
    the parallel head, which plans each task. Set once its first batch
    and its iterator's bytes were found, through the plain head."""
    self.head_reads = head_reads.HeadReads(self.config.name, self.info.config_fingerprint,
                                           len(self.head), len(self.records), record_needs)
    self._head_factory = lambda ds: head_reads.PlannedHead(ds, self.head_reads)

  def use_head(self, factory: HeadFactory, *, elements_held: int = 0) -> None:
    """Serves the head through `factory` (the parallel head of a server):
    it must yield what `to_iter_dataset()` yields, with the same states.
    `elements_held`: how many head elements one of its iterators keeps
    computed ahead (for `iterator_bytes`)."""
    self._head_factory = factory
    self._head_elements_held = elements_held

  # -- the pipeline -----------------------------------------------------------

  def pipeline(self, global_batch_size: int, *, head: HeadFactory | None = None
               ) -> grain.IterDataset:
    """The contract's Grain pipeline for G (the oracle, with `head` None)."""
    ds = (head or (lambda d: d.to_iter_dataset()))(self.head)
    if self._iter_fn is not None:
      if self._check_files is not None:
        self._check_files()
      with pipelines.building_from(self.config.base_dir):
        ds = self._iter_fn(ds, **self.config.iter_options)
      if not isinstance(ds, grain.IterDataset):
        raise ConfigError(f"dataset {self.config.name!r}: iter_pipeline "
                          f"{self.config.iter_pipeline!r} returned {type(ds).__name__}, "
                          "expected a grain.IterDataset")
    return ds.batch(global_batch_size, drop_remainder=self.config.drop_remainder,
                    batch_fn=self._batch_fn(global_batch_size))

  def _batch_fn(self, global_batch_size: int) -> Callable[[list[Any]], Any] | None:
    """Grain's batch_fn for G: the config's (given G as `batch_size` if it
    takes one, as grain.experimental.batch_and_pad does), in evaluation mode
    padded to G with the mask added."""
    fn = self._user_batch_fn
    if fn is not None and "batch_size" in _parameters(fn):
      fn = functools.partial(fn, batch_size=global_batch_size)
    if self.config.drop_remainder:
      return fn
    return functools.partial(_padded_with_mask, fn=fn, rows=global_batch_size)

  def _first_batch(self) -> tuple[Any, str]:
    """The first batch of one row, whose leaves give the row spec, and the
    stream's first position."""
    name = self.config.name
    try:
      it = iter(self.pipeline(1, head=self._head_factory))  # no read threads left behind
      start = dumps(it.get_state())
      batch = next(it)
    except StopIteration:
      raise ConfigError(f"dataset {name!r}: the stream is empty") from None
    except (ConfigError, ShardChangedError):
      raise
    except Exception as e:
      raise ConfigError(f"dataset {name!r}: the stream fails on its first batch: "
                        f"{type(e).__name__}: {e}") from e
    leaves, structure, paths = tree.flatten(batch)
    rows = []
    for path, leaf in zip(paths, leaves):
      a = np.asarray(leaf)
      if a.ndim < 1 or a.shape[0] != 1 or a.dtype.hasobject:
        raise ConfigError(
            f"dataset {name!r}: leaf {path!r} of a batch of one is {a.dtype}{list(a.shape)}; "
            "every leaf must be a numeric array with one row per element (a batch_fn "
            "keeps the batch dimension first)")
      rows.append(a[0])
    return tree.unflatten(structure, rows), start

  # -- serving ----------------------------------------------------------------

  def open(self, global_batch_size: int, state: str) -> grain.DatasetIterator:
    """The served pipeline's iterator for G at position `state` ("" = start,
    else canonical text, checked by shape: `parse_position`). Its head
    stops when the request producing stops being wanted (cancellation.py).
    A position Grain's own iterator does not read back the same is refused:
    Grain restores what it understands and ignores the rest, and a
    position it ignored parts of would be served as another one."""
    head = self._head_factory
    it = iter(self.pipeline(global_batch_size,
                            head=lambda ds: cancellation.Checked(head(ds))))
    if state:
      name = self.config.name
      try:
        it.set_state(grain_private.state_from_json(json.loads(state)))
        back = dumps(it.get_state())
      except Exception as e:  # a position of another pipeline, or made up
        raise InvalidRequestError(
            f"dataset {name!r}: stream_state is not a position of this stream: Grain "
            f"refused it ({type(e).__name__})") from None
      if back != state:
        raise InvalidRequestError(
            f"dataset {name!r}: stream_state is not a position of this stream: Grain "
            "restores another position from it")
    return it

  def iterator_bytes(self, global_batch_size: int) -> int:
    """An estimate of the memory one live iterator of G keeps: what one
    held after its first batch at start-up (measured, G = 1), the head
    elements it computes ahead, and one global batch (Grain's batch and a
    packer's bins hold about that many rows)."""
    return (self._iterator_base_bytes + self._head_elements_held * self._element_bytes
            + global_batch_size * self.info.element_spec.record_bytes)

  def _measure_iterator(self) -> tuple[int, int]:
    """(bytes a live iterator holds after a batch of one, bytes of a head
    element), found once, at start-up, by walking what they reference
    beyond what this dataset already holds (object_bytes.py)."""
    shared = object_bytes.reachable([self])
    it = iter(self.pipeline(1, head=self._head_factory))
    next(it)
    held = object_bytes.graph_bytes([it], shared=shared)
    elements = []
    for i in range(min(_MEASURED_ELEMENTS, len(self.head))):
      try:
        elements.append(self.head[i])
      except Exception:  # pylint: disable=broad-except
        continue  # a record that fails fails when served, with its step named
    element = object_bytes.graph_bytes(elements, shared=shared) // max(1, len(elements))
    return held, element

  def next_batch(self, it: grain.DatasetIterator, global_batch_size: int
                 ) -> GlobalBatch | None:
    """The next global batch of `it` and the position after it; None at the end."""
    try:
      batch = next(it)
    except StopIteration:
      return None
    leaves, _, paths = tree.flatten(batch)
    if len(leaves) != len(self._leaves):
      raise ConfigError(f"dataset {self.config.name!r}: a batch has {len(leaves)} leaves, "
                          f"the first had {len(self._leaves)}")
    out = []
    for leaf, want, path in zip(leaves, self._leaves, paths):
      a = np.asarray(leaf)
      if a.dtype != want.dtype or a.shape != (global_batch_size, *want.shape):
        raise ConfigError(
            f"dataset {self.config.name!r}: leaf {path!r} is {a.dtype}{list(a.shape)}, "
            f"the stream's rows are {want.dtype}{list(want.shape)} (G={global_batch_size}); "
            "a stream dataset needs fixed row shapes: pack or pad to a fixed length")
      out.append(a)
    state = dumps(it.get_state())
    if len(state) > MAX_STREAM_STATE_BYTES:
      raise ConfigError(
          f"dataset {self.config.name!r}: its pipeline's position is {len(state)} bytes of "
          f"JSON, over the {MAX_STREAM_STATE_BYTES} a request can carry back "
          "(proto/limits.py): an iterator state should hold positions and counters, "
          "never elements")
    return out, state

  def fast_forward(self, global_batch_size: int, state: str, num_steps: int
                   ) -> tuple[int, str]:
    """Moves past `num_steps` global batches of G from position `state`
    without keeping any (a skip): (how many there were, fewer if the stream
    ended first; the position after them). The batches are made, since a
    packer's rows depend on every element before them, but never sent."""
    it = self.open(global_batch_size, state)
    done = 0
    for done in range(num_steps):
      try:
        next(it)
      except StopIteration:
        break
    else:
      done = num_steps
    return done, dumps(it.get_state())

  def batches(self, global_batch_size: int, state: str) -> Iterator[GlobalBatch]:
    """Global batches from position `state` to the stream's end."""
    it = self.open(global_batch_size, state)
    while (batch := self.next_batch(it, global_batch_size)) is not None:
      yield batch


def _parameters(fn: Callable[..., Any]) -> set[str]:
  try:
    return set(inspect.signature(fn).parameters)
  except (TypeError, ValueError):  # a builtin without a signature
    return set()


def _padded_with_mask(values: list[Any], *, fn: Callable[[list[Any]], Any] | None,
                      rows: int) -> Any:
  """Evaluation mode's batch: `fn`'s (or stacked), padded with zero rows to
  `rows`, with the mask leaf (True for the len(values) real rows)."""
  batch = fn(values) if fn is not None else tree.unflatten(
      tree.flatten(values[0])[1],
      [np.stack(column) for column in zip(*(tree.flatten(v)[0] for v in values))])
  if not isinstance(batch, dict) or contract.MASK_KEY in batch:
    raise ConfigError(f"drop_remainder = false (evaluation mode) needs batches that are "
                      f"dicts without a {contract.MASK_KEY!r} key, for the mask it adds")
  leaves, structure, _ = tree.flatten(batch)
  padded = []
  for leaf in leaves:
    a = np.asarray(leaf)
    if a.shape[0] < rows:
      a = np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])
    padded.append(a)
  out = tree.unflatten(structure, padded)
  mask = np.zeros(rows, np.bool_)
  mask[:len(values)] = True
  out[contract.MASK_KEY] = mask
  return out
