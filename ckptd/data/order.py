"""The global sample order: a pure function of (manifest sample counts, seed, epoch).

Shard-level shuffle: the shards are permuted with a generator seeded by (seed, epoch). Within-shard
shuffle: consecutive groups of ``block_shards`` shards of that permutation form *blocks*, and the
samples of each block are permuted together (seeded by seed, epoch and the block number), which mixes
samples of several shards while a loader only needs one block's shards at a time. Position ``p`` of
the epoch is therefore one (shard, sample) pair, whatever the world size or worker count.

:class:`RankSchedule` cuts this sequence into global batches and gives each rank its slice: global
step ``k`` covers positions ``[start + k * G, start + (k + 1) * G)`` and rank ``r`` of ``W`` takes the
``G / W`` positions beginning at ``start + k * G + r * G / W``. The final partial global batch of an
epoch is dropped, so all ranks take the same number of steps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptd.errors import ConfigError

_SHARD_STREAM = 0
_BLOCK_STREAM = 1
_CACHED_BLOCKS = 4


def _generator(seed: int, epoch: int, stream: int, block: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stream, block])))


class EpochOrder:
    """The sample sequence of one epoch. Cheap to build; blocks are computed on demand."""

    def __init__(self, sample_counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool = True,
                 block_shards: int = 4) -> None:
        if block_shards < 1:
            raise ConfigError(f"block_shards must be >= 1, got {block_shards}")
        if seed < 0 or epoch < 0:
            raise ConfigError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
        self.counts = np.asarray(sample_counts, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        shards = len(self.counts)
        self.shard_sequence = (_generator(seed, epoch, _SHARD_STREAM).permutation(shards) if shuffle
                               else np.arange(shards))
        width = block_shards if shuffle else 1
        self.blocks = [self.shard_sequence[i:i + width] for i in range(0, shards, width)]
        self.block_ends = np.cumsum([int(self.counts[block].sum()) for block in self.blocks], dtype=np.int64)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    @property
    def total(self) -> int:
        """Samples in the epoch."""
        return int(self.block_ends[-1]) if len(self.block_ends) else 0

    def block_of(self, position: int) -> int:
        """Block that holds ``position``."""
        return int(np.searchsorted(self.block_ends, position, side="right"))

    def block_start(self, block: int) -> int:
        return int(self.block_ends[block - 1]) if block else 0

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if block in self._cache:
            self._cache.move_to_end(block)
            return self._cache[block]
        shards = self.blocks[block]
        shard_ids = np.repeat(shards, self.counts[shards])
        local = np.concatenate([np.arange(self.counts[s], dtype=np.int64) for s in shards]) if len(shards) \
            else np.zeros(0, dtype=np.int64)
        if self.shuffle:
            permutation = _generator(self.seed, self.epoch, _BLOCK_STREAM, block).permutation(len(local))
            shard_ids, local = shard_ids[permutation], local[permutation]
        self._cache[block] = (shard_ids, local)
        if len(self._cache) > _CACHED_BLOCKS:
            self._cache.popitem(last=False)
        return shard_ids, local

    def samples(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(shard index, sample index in shard) for every position in ``[start, stop)``."""
        if start < 0 or stop > self.total or start > stop:
            raise IndexError(f"positions [{start}, {stop}) are outside the epoch of {self.total} samples")
        found: list[tuple[int, int]] = []
        position = start
        while position < stop:
            block = self.block_of(position)
            base = self.block_start(block)
            end = min(stop, int(self.block_ends[block]))
            shard_ids, local = self._block(block)
            found.extend(zip(shard_ids[position - base:end - base].tolist(), local[position - base:end - base].tolist()))
            position = end
        return found

    def shards_from(self, position: int, count: int) -> list[int]:
        """The next ``count`` shards in the order blocks use them, starting with the block after
        ``position``'s block (what a prefetcher should fetch next)."""
        block = self.block_of(position) + 1
        upcoming = [int(s) for b in self.blocks[block:] for s in b]
        return upcoming[:count]


@dataclass(frozen=True)
class RankSchedule:
    """Which positions of an epoch one rank reads, batch by batch."""

    global_batch_size: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not within world size {self.world_size}")
        if self.global_batch_size < 1 or self.global_batch_size % self.world_size:
            raise ConfigError(f"the global batch size {self.global_batch_size} is not a positive multiple of "
                              f"the world size {self.world_size}",
                              hint="pick a global batch size that every world size you use divides")

    @property
    def rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def steps(self, epoch_total: int, start: int) -> int:
        """Global steps left in an epoch of ``epoch_total`` samples from position ``start``."""
        return max(epoch_total - start, 0) // self.global_batch_size

    def rank_slice(self, start: int, step: int) -> tuple[int, int]:
        """Positions ``[first, stop)`` this rank reads at global step ``step`` counted from ``start``."""
        first = start + step * self.global_batch_size + self.rank * self.rank_batch_size
        return first, first + self.rank_batch_size
