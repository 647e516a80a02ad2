"""The batch-at-a-time shuffle gives exactly Grain's permutation."""

from __future__ import annotations

import random

import grain
import numpy as np
import pytest
from grain_elevator.server.data.grain_private import index_shuffle as grain_index_shuffle

from grain_elevator.server.data import shuffle

pytestmark = pytest.mark.grain_contract  # run again on the lowest Grain admitted

# Lengths around the cipher's block-width steps (2^16, 2^20: the width that
# holds n - 1 changes there) and a few ordinary ones. Tiny lengths walk up to
# 2^16 / n rounds per index, too slow to test here (and not served this way).
LENGTHS = [1, 8_193, 65_535, 65_536, 65_537, 200_000, (1 << 20) + 1, 10**7,
           3_000_000_019]
SEEDS = [0, 1, 12345, 2**32 - 1]


@pytest.mark.parametrize("n", LENGTHS)
def test_index_shuffle_matches_grain(n):
  rng = random.Random(n)
  indices = sorted({0, n - 1, *(rng.randrange(n) for _ in range(200))})
  for seed in SEEDS + [rng.randrange(2**32)]:
    want = [grain_index_shuffle(i, n - 1, seed, 4) for i in indices]
    assert shuffle.index_shuffle(np.array(indices), n - 1, seed).tolist() == want


@pytest.mark.parametrize("n", [2_048, 4_000, 8_191])
def test_epoch_permutation_is_index_shuffle_of_every_record(n):
  perm = shuffle.epoch_permutation(n, 99)
  assert perm.tolist() == shuffle.index_shuffle(np.arange(n), n - 1, 99).tolist()
  sample = range(0, n, 97)
  assert [perm[i] for i in sample] == [
      grain_index_shuffle(i, n - 1, 99, 4) for i in sample]


def test_index_shuffle_is_a_permutation():
  out = shuffle.index_shuffle(np.arange(70_000), 69_999, 7)
  assert sorted(out.tolist()) == list(range(70_000))


def test_round_keys_are_seed_seq_words():
  # std::seed_seq{s}.generate() of 4 words, printed by a g++ 12 build: pins
  # the key schedule independently of Grain.
  assert shuffle.round_keys(0) == (0xB0A842FD, 0x04290315, 0x75A0ADFA, 0x1FB83B0F)
  assert shuffle.round_keys(1) == (0x4DC239DD, 0x529C8EC8, 0x60E79BF6, 0x624F7451)
  assert shuffle.round_keys(2**32 - 1) == (0xC2351C8E, 0xB16373FF, 0x0D9336E4, 0x2008463E)


@pytest.mark.parametrize("n,num_epochs,do_shuffle", [
    (10_000, None, True), (10_000, 3, True), (1_000, None, False), (1, None, True),
    (65_537, None, True), (2_048, None, True), (4_000, 3, True), (8_191, None, True)])
def test_source_index_map_matches_grain_chain(n, num_epochs, do_shuffle):
  chain = grain.MapDataset.source(range(n)).seed(42)
  if do_shuffle:
    chain = chain.shuffle()
  chain = chain.repeat(num_epochs)
  index = shuffle.SourceIndexMap(chain, n)
  assert index.vectorized
  length = min(len(chain), 10**9)
  rng = random.Random(0)
  # Whole batches within an epoch, across an epoch boundary, and far out.
  for start in [0, n - 5, 2 * n - 3, rng.randrange(length - 300), length - 256]:
    positions = list(range(max(0, start), min(length, max(0, start) + 256)))
    assert index(positions) == [int(i) for i in chain._getitems(positions)]


def test_source_index_map_leaves_tiny_datasets_to_grain():
  n = 1_000  # a 16-bit block: ~65 cycle-walk rounds per index
  chain = grain.MapDataset.source(range(n)).seed(3).shuffle().repeat()
  index = shuffle.SourceIndexMap(chain, n)
  assert not index.vectorized
  positions = list(range(n - 10, n + 10))
  assert index(positions) == [int(i) for i in chain._getitems(positions)]


def test_source_index_map_falls_back_to_the_chain_when_it_disagrees():
  n = 9_000
  chain = grain.MapDataset.source(range(n)).seed(3).shuffle().repeat()
  chain = chain.map(lambda i: (i + 1) % n)  # a chain this map does not model
  index = shuffle.SourceIndexMap(chain, n)
  assert not index.vectorized
  positions = list(range(n - 10, n + 10))
  assert index(positions) == [int(i) for i in chain._getitems(positions)]
