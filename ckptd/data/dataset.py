"""ShardDataset: a torch IterableDataset that yields this rank's slice of every global batch.

Each item is a :class:`RankBatch`: one rank's ``global_batch_size / world_size`` samples of one global
step, collated by ``collate_fn`` (torch tensors by default, see :mod:`ckptd.data.collate`), tagged with
the epoch position it ends at and, when asked for, the ids of its samples. The default collation ends
in the training process: a custom loader takes ``item.finished().batch``. Under a DataLoader with ``num_workers=K``, worker ``w`` produces the batches of steps ``w, w+K, ...``;
the DataLoader takes one batch from each worker in turn, so the training loop sees the same sequence
as with no workers. Use :class:`ckptd.data.ShardLoader` to get this wiring plus a resumable state;
iterate the dataset alone only for custom loaders.

Call order: construct anywhere (nothing is fetched or started, and without ``rank``/``world_size``
the rank is not read yet); :meth:`ShardDataset.set_position` before iterating; the first iteration (or
:meth:`ShardDataset.bind`) takes rank and world size from torch.distributed; iteration starts the cache, fetcher and prefetch threads in the iterating process
and stops them when the iteration ends or is abandoned.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ckptd.config import settings
from ckptd.data.cache import ShardCache
from ckptd.data.collate import CollateFn, Finish, stack_samples
from ckptd.data.fetch import VerifiedFetcher
from ckptd.data.manifest import DatasetManifest, load_dataset_manifest
from ckptd.data.order import EpochOrder, RankSchedule
from ckptd.data.reading import CORRUPT_POLICIES, ShardReading
from ckptd.data.registry import make_reader
from ckptd.data.source import ShardSource
from ckptd.errors import ConfigError


@dataclass(frozen=True)
class RankBatch:
    """One rank's slice of one global step, as produced by :class:`ShardDataset`."""

    epoch: int
    #: Global samples of the epoch consumed once this step is done (by all ranks together).
    end_position: int
    #: The collated samples (fewer than the rank batch size only if on_corrupt="skip" dropped some).
    batch: Any
    #: Shards this worker skipped for the first time while building this batch.
    newly_skipped: tuple[str, ...] = ()
    #: ``"<shard path>#<index in shard>"`` of every sample, in batch order (when the loader asks for them).
    sample_ids: tuple[str, ...] | None = None
    #: What the training process still applies to ``batch`` (see :class:`~ckptd.data.collate.Finish`).
    finish: Callable[[Any], Any] | None = None

    def finished(self) -> RankBatch:
        """This batch in its final form (tensors, split into inputs and targets)."""
        if self.finish is None:
            return self
        return dataclasses.replace(self, batch=self.finish(self.batch), finish=None)

    def pin_memory(self) -> RankBatch:
        """This batch, finished, with its tensors in pinned memory (DataLoader's ``pin_memory=True`` calls
        this in its pinning thread)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        done = self.finished()
        return dataclasses.replace(done, batch=pin_memory(done.batch))


def distributed_rank_and_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when it is initialised, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class ShardDataset(IterableDataset):  # type: ignore[type-arg]
    """Verified, deterministically shuffled shards of a dataset manifest, sliced for one rank.

    ``manifest``: a :class:`DatasetManifest` or the path/URL of its JSON file. ``global_batch_size``:
    samples per global step over all ranks (a multiple of the world size). ``seed``: with the epoch, it
    fixes the order. ``block_shards``: shards whose samples are shuffled together. ``rank`` and
    ``world_size`` default to torch.distributed's, taken when the first iteration starts (:meth:`bind`),
so the dataset may be built before the process group exists. ``root`` reads the shards from another root than
    the manifest's. ``cache_dir``/``cache_bytes`` place and bound the local shard cache.
    ``verify=False`` skips digest checks (benchmarks only). ``on_corrupt``: ``"raise"`` or ``"skip"``.
    ``collate_fn`` builds a batch from the list of samples (default :func:`~ckptd.data.collate.
    tensor_batch`: tensors, token windows as int64 ``[batch, seq_len]``; pass
    :func:`~ckptd.data.collate.list_batch` for the samples as read). ``split_targets=True`` yields
    ``(inputs, targets) = (tokens[:, :-1], tokens[:, 1:])`` for next-token prediction.
    """

    def __init__(
        self,
        manifest: DatasetManifest | str | os.PathLike[str],
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        block_shards: int = 4,
        rank: int | None = None,
        world_size: int | None = None,
        root: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = None,
        verify: bool = True,
        on_corrupt: str = "raise",
        collate_fn: CollateFn | None = None,
        split_targets: bool = False,
        prefetch_shards: int | None = None,
        fetch_attempts: int | None = None,
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        if not isinstance(manifest, DatasetManifest):
            manifest = load_dataset_manifest(manifest, storage_options=self.storage_options)
        self.manifest = manifest.with_root(root) if root is not None else manifest
        if on_corrupt not in CORRUPT_POLICIES:
            raise ConfigError(f"on_corrupt must be one of {CORRUPT_POLICIES}, got {on_corrupt!r}")
        self.global_batch_size = global_batch_size
        #: The rank and world size given to the constructor (None: torch.distributed's, at :meth:`bind`).
        self.fixed_rank, self.fixed_world_size = rank, world_size
        #: Whether a process group existed when the dataset was bound (None: not bound yet).
        self._bound_in_group: bool | None = None
        self._schedule = self._current_schedule()
        self.reader = make_reader(self.manifest.format, dict(self.manifest.reader_options))
        if seed < 0 or block_shards < 1:
            raise ConfigError(f"seed must be >= 0 and block_shards >= 1, got {seed} and {block_shards}")
        self.seed, self.shuffle, self.block_shards = seed, shuffle, block_shards
        self.cache_dir, self.cache_bytes = cache_dir, cache_bytes
        self.verify, self.on_corrupt = verify, on_corrupt
        self.collate_fn: CollateFn = collate_fn or stack_samples
        finish = Finish(tensors=collate_fn is None, split_targets=split_targets)
        #: Applied to each batch in the training process (None: the collated batch is final).
        self.finish: Callable[[Any], Any] | None = finish if (finish.tensors or finish.split_targets) else None
        #: Whether batches carry their sample ids (set by the loader through :meth:`set_position`).
        self.sample_ids = False
        self.prefetch_shards = settings().data_prefetch_shards if prefetch_shards is None else prefetch_shards
        self.fetch_attempts = fetch_attempts
        self._epoch, self._start, self._skipped = 0, 0, frozenset[str]()

    # --- binding to the process group --------------------------------------------------------------
    def _current_schedule(self) -> RankSchedule:
        rank, world_size = self.fixed_rank, self.fixed_world_size
        if rank is None or world_size is None:
            found_rank, found_world = distributed_rank_and_world()
            rank = found_rank if rank is None else rank
            world_size = found_world if world_size is None else world_size
        return RankSchedule(self.global_batch_size, world_size, rank)

    @property
    def schedule(self) -> RankSchedule:
        """The slice of every global batch this rank reads: the bound one, or before the first
        :meth:`bind` the one torch.distributed's current process group gives (not kept)."""
        if self._bound_in_group is None and (self.fixed_rank is None or self.fixed_world_size is None):
            self._schedule = self._current_schedule()
        return self._schedule

    @property
    def bound(self) -> bool:
        """Whether the rank and world size are fixed: given to the constructor, or taken by :meth:`bind`."""
        return self._bound_in_group is not None or (self.fixed_rank is not None and
                                                    self.fixed_world_size is not None)

    def bind(self) -> RankSchedule:
        """Take this rank's place from torch.distributed now (called when an iteration starts, in the
        process that iterates: :class:`~ckptd.data.ShardLoader` does it before it starts workers).

        The first call fixes rank and world size (those not given to the constructor): the default process
        group's, or (0, 1) without one, so a dataset built before ``init_process_group`` (an elastic
        job's ``setup_fn``) reads the right slice once the group exists. Bound inside a process group, a
        later call follows the current group (a new generation of ``ckptd launch``, formed again after a
        failure); bound outside any group, it raises ConfigError when it is used inside a group of several
        ranks, and bound inside one, when it is used with none (the slices would overlap or leave samples
        out)."""
        if self.fixed_rank is not None and self.fixed_world_size is not None:
            return self._schedule
        in_group = _in_process_group()
        current = self._current_schedule()
        bound = self._schedule
        if self._bound_in_group is not None and in_group != self._bound_in_group and \
                (current.rank, current.world_size) != (bound.rank, bound.world_size):
            where = "inside a process group" if self._bound_in_group else "without a process group"
            now = "inside one" if in_group else "without one"
            raise ConfigError(
                f"this ShardDataset took rank {bound.rank} of {bound.world_size} when it was first iterated "
                f"({where}), but it is now iterated {now}, as rank {current.rank} of {current.world_size}: "
                "the ranks' slices of each global batch would overlap or leave samples out",
                hint="iterate it first after init_process_group (under ckptd.elastic.run: in train_fn), or "
                     "pass rank= and world_size= to ShardDataset")
        self._schedule, self._bound_in_group = current, in_group
        return current

    def set_position(self, epoch: int, start: int, skipped: frozenset[str] = frozenset(), *,
                     sample_ids: bool = False) -> None:
        """Where the next iteration begins: ``start`` global samples into ``epoch``, leaving out the
        shards in ``skipped``; ``sample_ids``: batches carry the ids of their samples. Workers copy this
        when a DataLoader iterator is created."""
        if epoch < 0 or start < 0:
            raise ConfigError(f"epoch and start position must be >= 0, got {epoch} and {start}")
        self._epoch, self._start, self._skipped = epoch, start, frozenset(skipped)
        self.sample_ids = sample_ids

    def epoch_order(self, epoch: int) -> EpochOrder:
        """The global sample order of ``epoch``."""
        return EpochOrder([s.samples for s in self.manifest.shards], seed=self.seed, epoch=epoch,
                          shuffle=self.shuffle, block_shards=self.block_shards)

    def steps_in_epoch(self, start: int = 0) -> int:
        """Global steps in an epoch from position ``start`` (all epochs have the same length)."""
        return self.schedule.steps(self.manifest.total_samples, start)

    def _reading(self) -> ShardReading:
        cache = ShardCache(self.cache_dir, self.cache_bytes)
        fetcher = VerifiedFetcher(ShardSource(self.manifest.root, self.storage_options), cache,
                                  verify=self.verify, attempts=self.fetch_attempts)
        return ShardReading(self.manifest, self.reader, fetcher, on_corrupt=self.on_corrupt,
                            skipped=self._skipped, prefetch_shards=self.prefetch_shards,
                            open_shards=2 * self.block_shards)

    def _ids(self, pairs: list[tuple[int, int]], skipped: set[str]) -> tuple[str, ...]:
        paths = [shard.path for shard in self.manifest.shards]
        return tuple(f"{paths[shard]}#{index}" for shard, index in pairs if paths[shard] not in skipped)

    def __iter__(self) -> Iterator[RankBatch]:
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        # a DataLoader worker cannot see the training process's group: it reads the slice its copy of the
        # dataset holds (bound by ShardLoader before it started the workers; a custom loader calls bind())
        schedule = self.bind() if worker is None else self._schedule
        epoch, start = self._epoch, self._start
        order = self.epoch_order(epoch)
        reading = self._reading()
        try:
            for step in range(worker_id, schedule.steps(order.total, start), workers):
                first, stop = schedule.rank_slice(start, step)
                reading.advance(order, first)
                pairs = order.samples(first, stop)
                samples = reading.samples(pairs)
                newly, reading.newly_skipped = tuple(reading.newly_skipped), []
                yield RankBatch(epoch=epoch, end_position=start + (step + 1) * schedule.global_batch_size,
                                batch=self.collate_fn(samples), newly_skipped=newly,
                                sample_ids=self._ids(pairs, reading.skipped) if self.sample_ids else None,
                                finish=self.finish)
        finally:
            reading.close()
