"""Samples by (shard, index) for one loading process: verified opens, prefetch, corrupt-shard policy.

A :class:`ShardReading` lives for one pass of one process (the main process, or one DataLoader worker)
over an epoch. It keeps the most recently used shards open in memory, asks the prefetcher for the
shards of the next block, and applies the ``on_corrupt`` policy: ``"raise"`` lets the IntegrityError
or NotFoundError of a quarantined shard through; ``"skip"`` marks the shard as skipped, so its samples
are left out of every batch from then on (a deterministic choice, recorded in the loader state).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ckptd.data.fetch import VerifiedFetcher
from ckptd.data.manifest import DatasetManifest
from ckptd.data.order import EpochOrder
from ckptd.data.prefetch import Prefetcher
from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader
from ckptd.errors import FormatError, IntegrityError, NotFoundError

log = logging.getLogger("ckptd.data")

#: Values of ``on_corrupt``.
CORRUPT_POLICIES = ("raise", "skip")


class ShardReading:
    """Opens shards of ``manifest`` through ``fetcher`` and hands out samples."""

    def __init__(self, manifest: DatasetManifest, reader: ShardReader, fetcher: VerifiedFetcher, *,
                 on_corrupt: str, skipped: Iterable[str], prefetch_shards: int, open_shards: int) -> None:
        self.manifest = manifest
        self.reader = reader
        self.fetcher = fetcher
        self.on_corrupt = on_corrupt
        #: Paths of shards whose samples are left out (on_corrupt="skip").
        self.skipped: set[str] = set(skipped)
        #: Shards this process skipped for the first time (reported to the loader's state).
        self.newly_skipped: list[str] = []
        self._open: OrderedDict[int, OpenShard] = OrderedDict()
        self._open_limit = max(open_shards, 1)
        self._prefetch_count = prefetch_shards
        self._prefetcher = Prefetcher(fetcher.load, threads=min(max(prefetch_shards, 1), 4)) \
            if prefetch_shards > 0 else None
        self._block_seen = -1

    def advance(self, order: EpochOrder, position: int) -> None:
        """Tell the reading where the next batch starts; entering a block queues prefetches."""
        block = order.block_of(position)
        if self._prefetcher is None or block == self._block_seen or block >= len(order.blocks):
            return
        self._block_seen = block
        ahead = max(self._prefetch_count, len(order.blocks[block + 1]) if block + 1 < len(order.blocks) else 0)
        wanted = [int(s) for s in order.blocks[block]] + order.shards_from(position, ahead)
        self._prefetcher.schedule(self.manifest.shards[s] for s in wanted
                                  if s not in self._open and self.manifest.shards[s].path not in self.skipped)

    def _shard(self, index: int) -> OpenShard | None:
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        record = self.manifest.shards[index]
        if record.path in self.skipped:
            return None
        try:
            data = self._prefetcher.take(record) if self._prefetcher is not None else None
            if data is None:
                data = self.fetcher.load(record)
        except (IntegrityError, NotFoundError) as exc:
            if self.on_corrupt != "skip":
                raise
            log.warning("skipping every sample of shard %s: %s", record.path, exc)
            self.skipped.add(record.path)
            self.newly_skipped.append(record.path)
            return None
        opened = self.reader.open(data, ShardLayout(record.samples, record.layout),
                                  self.fetcher.source.url(record.path))
        if len(opened) != record.samples:
            raise FormatError(f"shard holds {len(opened)} samples but the manifest says {record.samples}",
                              path=self.fetcher.source.url(record.path), hint="re-index the dataset")
        self._open[index] = opened
        while len(self._open) > self._open_limit:
            self._open.popitem(last=False)
        return opened

    def samples(self, pairs: Iterable[tuple[int, int]]) -> list[Any]:
        """The samples for (shard, index) pairs, in order, leaving out skipped shards."""
        found = []
        handles: dict[int, OpenShard | None] = {}
        for shard, local in pairs:
            if shard in handles:
                opened = handles[shard]
            else:
                opened = handles[shard] = self._shard(shard)
            if opened is not None:
                found.append(opened[local])
        return found

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._open.clear()
