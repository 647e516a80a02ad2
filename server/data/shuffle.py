"""Grain's global shuffle, computed for a whole batch of positions at once.

`MapDataset.seed(s).shuffle().repeat()` maps stream position p to source
record index_shuffle(p mod n, n - 1, s + p div n, rounds=4): a 4-round Simon
Feistel cipher over the smallest even bit width (at least 16) that holds
n - 1, cycle-walked until the value lands in range, with round keys from C++'s
`std::seed_seq{seed}`. Grain evaluates it one index per C++ call, ~7 µs a
record through its Python layers, about a third of what reading a small record
costs. This is the same permutation, evaluated with numpy over the batch;
tests/server/data/test_shuffle.py checks it against Grain's own function, and
`SourceIndexMap` checks it against the dataset's Grain chain at start-up.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from grain_elevator.server.data import grain_private

ROUNDS = 4  # what ShuffleMapDataset uses
# Source indices kept of recent runs of stream positions (a host's step):
# 16 MB of them.
RECENT_INDICES = 1 << 21
_U32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=64)
def round_keys(seed: int, rounds: int = ROUNDS) -> tuple[int, ...]:
  """`std::seed_seq{seed}.generate()` of `rounds` words ([rand.util.seedseq])."""
  n, s, v = rounds, 1, (seed & _U32,)
  out = [0x8B8B8B8B] * n
  t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
  p = (n - t) // 2
  q = p + t
  m = max(s + 1, n)

  def mix(x: int) -> int:
    return x ^ (x >> 27)

  for k in range(m):
    r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _U32
    if k == 0:
      r2 = r1 + s
    elif k <= s:
      r2 = r1 + k % n + v[k - 1]
    else:
      r2 = r1 + k % n
    r2 &= _U32
    out[(k + p) % n] = (out[(k + p) % n] + r1) & _U32
    out[(k + q) % n] = (out[(k + q) % n] + r2) & _U32
    out[k % n] = r2
  for k in range(m, m + n):
    r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _U32)) & _U32
    r4 = (r3 - k % n) & _U32
    out[(k + p) % n] ^= r3
    out[(k + q) % n] ^= r4
    out[k % n] = r4
  return tuple(out)


def block_bits(max_index: int) -> int:
  """The cipher's block width for a permutation of [0, max_index]."""
  bits = math.ceil(math.log2(max_index))
  return min(max(bits + bits % 2, 16), 64)


# Below this many records the cipher's 16-bit minimum block makes each index
# cycle-walk 2^16 / n times: from 8,192 records (at most 8 rounds) the batch is
# encrypted directly; from 2,048 the epoch's whole permutation is built once
# from a table of all 2^16 blocks; below that Grain's C++ loop is faster.
DIRECT_MIN_RECORDS = 8_192
TABLE_MIN_RECORDS = 2_048


def _cipher(max_index: int, seed: int, rounds: int) -> Callable[[np.ndarray], np.ndarray]:
  """Grain's Simon encryption of a uint64 array, for a permutation of [0, max_index]."""
  half = block_bits(max_index) // 2
  w, mask = np.uint64(half), np.uint64((1 << half) - 1)
  keys = [np.uint64(k & ((1 << half) - 1)) for k in round_keys(seed, rounds)]

  def rotl(x: np.ndarray, r: int) -> np.ndarray:
    return ((x << np.uint64(r)) | (x >> np.uint64(half - r))) & mask

  def encrypt(x: np.ndarray) -> np.ndarray:
    left, right = (x >> w) & mask, x & mask  # std::bitset<W> keeps the low W bits
    for i in range(0, rounds, 2):
      left ^= (rotl(right, 1) & rotl(right, 8)) ^ rotl(right, 2) ^ keys[i]
      right ^= (rotl(left, 1) & rotl(left, 8)) ^ rotl(left, 2) ^ keys[i + 1]
    return (left << w) | right

  return encrypt


def _walk(out: np.ndarray, step: Callable[[np.ndarray], np.ndarray], limit: int) -> np.ndarray:
  """Cycle-walks, in place, the values of `out` that left [0, limit]."""
  top = np.uint64(limit)
  todo = np.flatnonzero(out > top)
  while todo.size:
    out[todo] = step(out[todo])
    todo = todo[out[todo] > top]
  return out


def index_shuffle(indices: np.ndarray, max_index: int, seed: int,
                  rounds: int = ROUNDS) -> np.ndarray:
  """Grain's `index_shuffle` of every element of `indices` (all ≤ max_index)."""
  indices = np.asarray(indices, dtype=np.uint64)
  if max_index == 0:
    return np.zeros_like(indices)
  encrypt = _cipher(max_index, seed, rounds)
  return _walk(encrypt(indices), encrypt, max_index)


@functools.lru_cache(maxsize=4)
def epoch_permutation(num_records: int, seed: int, rounds: int = ROUNDS) -> np.ndarray:
  """`index_shuffle(i, num_records - 1, seed)` for every i, from a table of
  the cipher over its whole block (datasets of up to 2^16 records)."""
  if num_records <= 1:
    return np.zeros(num_records, dtype=np.uint64)
  max_index = num_records - 1
  table = _cipher(max_index, seed, rounds)(
      np.arange(1 << block_bits(max_index), dtype=np.uint64))
  table.flags.writeable = False
  out = table[:num_records].copy()
  _walk(out, lambda x: table[x], max_index)
  out.flags.writeable = False
  return out


def vectorizable(num_records: int) -> bool:
  """Whether `source_indices` is faster than Grain for this many records."""
  return num_records <= 1 or num_records >= TABLE_MIN_RECORDS


def source_indices(positions: Sequence[int], num_records: int,
                   shuffle_seed: int | None) -> list[int]:
  """The source record behind each stream position of a repeated stream,
  shuffled per epoch with `shuffle_seed` (None: not shuffled)."""
  pos = np.asarray(positions, dtype=np.uint64)
  epoch, within = np.divmod(pos, np.uint64(num_records))
  if shuffle_seed is None:
    return within.tolist()
  out = np.empty_like(within)
  for e in np.unique(epoch).tolist():  # a batch spans at most two epochs, usually one
    sel = epoch == e
    seed = (shuffle_seed + e) & _U32
    if num_records >= DIRECT_MIN_RECORDS:
      out[sel] = index_shuffle(within[sel], num_records - 1, seed)
    else:
      out[sel] = epoch_permutation(num_records, seed)[within[sel]]
  return out.tolist()


class SourceIndexMap:
  """Stream position -> source record, as a Grain chain
  `range(n).seed().shuffle().repeat()` maps it, a batch at a time.

  The shuffle's seed is the one Grain derived for the chain's shuffle node.
  At start-up the vectorised map is checked against the chain itself on
  positions of the first epochs; should a Grain release change either, the
  chain answers instead (correct, only slower).
  """

  def __init__(self, chain: Any, num_records: int):
    self._chain = chain
    self._num_records = num_records
    self._seed = _shuffle_seed(chain)
    self.vectorized = ((self._seed is None or vectorizable(num_records))
                       and self._agrees_with_chain())
    # Runs of positions recently mapped, (first, count) -> indices: a step's
    # run is mapped when its reads are planned and again when it is made.
    self._recent: collections.OrderedDict[tuple[int, int], np.ndarray] = (
        collections.OrderedDict())
    self._recent_size = 0
    self._lock = threading.Lock()

  def __call__(self, positions: Sequence[int]) -> list[int]:
    n = len(positions)
    key = None
    if n > 1 and positions[n - 1] - positions[0] == n - 1 and (
        isinstance(positions, range) or list(positions) == list(
            range(positions[0], positions[0] + n))):
      key = (int(positions[0]), n)
      with self._lock:
        hit = self._recent.get(key)
        if hit is not None:
          self._recent.move_to_end(key)
          return hit.tolist()
    if self.vectorized:
      out = source_indices(positions, self._num_records, self._seed)
    else:
      out = [int(i) for i in grain_private.getitems(self._chain, positions)]
    if key is not None and n <= RECENT_INDICES:
      with self._lock:
        if key not in self._recent:
          self._recent[key] = np.asarray(out, np.int64)
          self._recent_size += n
        while self._recent_size > RECENT_INDICES:
          self._recent_size -= len(self._recent.popitem(last=False)[1])
    return out

  def _agrees_with_chain(self) -> bool:
    n, length = self._num_records, len(self._chain)
    sample = [p for start in (0, n, 5 * n) for p in range(start, start + min(n, 16))
              if p < length]
    try:
      fast = source_indices(sample, n, self._seed)
    except (TypeError, ValueError, OverflowError):
      return False
    return fast == [int(i) for i in grain_private.getitems(self._chain, sample)]


def _shuffle_seed(chain: Any) -> int | None:
  """The seed of the (single) ShuffleMapDataset in a chain, None if none."""
  seeds, todo = [], [chain]
  while todo:
    node = todo.pop()
    if type(node).__name__ == "ShuffleMapDataset":
      seeds.append(getattr(node, "_seed", None))
    todo.extend(getattr(node, "_parents", ()))
  return seeds[0] if len(seeds) == 1 and isinstance(seeds[0], int) else None
