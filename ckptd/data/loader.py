"""ShardLoader: a DataLoader over a ShardDataset whose state is part of the checkpoint.

The state is (epoch, global samples consumed, seed, manifest digest) plus the shards skipped under
``on_corrupt="skip"``. "Consumed" counts batches handed to the training loop, not batches that workers
prepared ahead, so a checkpoint taken after step ``s`` resumes at step ``s + 1`` exactly, with any
world size or worker count. Put the loader in the state given to
:class:`ckptd.CheckpointManager`; it is saved and restored through :meth:`state_dict` /
:meth:`load_state_dict`.

Call order: construct; optionally :meth:`load_state_dict` (or ``CheckpointManager.restore``); iterate.
One iteration runs from the current position to the end of the epoch, then the state moves to the
start of the next epoch. Iterating from the main thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from ckptd.data.dataset import RankBatch, ShardDataset
from ckptd.errors import ConfigError, ResumeMismatchError

log = logging.getLogger("ckptd.data")

#: Version of the loader state layout.
STATE_VERSION = 1


@dataclass(frozen=True)
class LoaderState:
    """Where a ShardLoader stands; its JSON form is what the checkpoint holds."""

    epoch: int
    samples_consumed: int
    seed: int
    manifest_digest: str
    skipped_shards: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.epoch, "samples_consumed": self.samples_consumed,
                "seed": self.seed, "manifest_digest": self.manifest_digest,
                "skipped_shards": list(self.skipped_shards)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoaderState:
        if raw.get("version") != STATE_VERSION:
            raise ResumeMismatchError(f"data loader state version {raw.get('version')!r} is not supported "
                                      f"(expected {STATE_VERSION})", hint="resume with the ckptd that saved it")
        try:
            state = cls(epoch=int(raw["epoch"]), samples_consumed=int(raw["samples_consumed"]),
                        seed=int(raw["seed"]), manifest_digest=str(raw["manifest_digest"]),
                        skipped_shards=tuple(str(path) for path in raw.get("skipped_shards") or ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeMismatchError(f"the data loader state is malformed: {exc!r}",
                                      hint="was it saved by a ShardLoader?") from exc
        if state.epoch < 0 or state.samples_consumed < 0 or state.seed < 0:
            raise ResumeMismatchError(f"the data loader state holds negative values: {state}")
        return state


def _unwrapped(item: RankBatch) -> RankBatch:
    return item


class ShardLoader:
    """Iterates a :class:`ShardDataset` through a torch DataLoader and tracks the resumable state.

    ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``multiprocessing_context`` go to the
    DataLoader (workers are started for each epoch). ``allow_manifest_change=True`` lets
    :meth:`load_state_dict` accept a state saved with another manifest (the position is kept, the
    samples behind it differ).
    """

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, multiprocessing_context: Any = None,
                 allow_manifest_change: bool = False) -> None:
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.allow_manifest_change = allow_manifest_change
        self._epoch = 0
        self._consumed = 0
        self._skipped: set[str] = set()

    # --- position ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def samples_consumed(self) -> int:
        """Global samples (all ranks) of the current epoch handed to the training loop."""
        return self._consumed

    @property
    def skipped_shards(self) -> frozenset[str]:
        return frozenset(self._skipped)

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return self.dataset.steps_in_epoch(self._consumed)

    # --- iteration -----------------------------------------------------------------------------
    def _data_loader(self) -> DataLoader:  # type: ignore[type-arg]
        options: dict[str, Any] = {}
        if self.num_workers:
            options["multiprocessing_context"] = self.multiprocessing_context
            if self.prefetch_factor is not None:
                options["prefetch_factor"] = self.prefetch_factor
        # Starting a DataLoader iterator draws a base seed from the global torch RNG unless it has its own
        # generator; that extra draw at a resume would shift every later random number of the training.
        generator = torch.Generator().manual_seed(self.dataset.seed * 1_000_003 + self._epoch)
        return DataLoader(self.dataset, batch_size=None, collate_fn=_unwrapped, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, generator=generator, **options)

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches from the current position to the end of the epoch."""
        self.dataset.set_position(self._epoch, self._consumed, frozenset(self._skipped))
        for item in self._data_loader():
            if item.epoch != self._epoch:
                raise ResumeMismatchError(f"a worker produced a batch of epoch {item.epoch} during epoch "
                                          f"{self._epoch}", hint="do not change the loader while iterating")
            self._consumed = item.end_position
            self._skipped.update(item.newly_skipped)
            yield item.batch
        self._epoch += 1
        self._consumed = 0

    # --- checkpoint state ----------------------------------------------------------------------
    def loader_state(self) -> LoaderState:
        return LoaderState(epoch=self._epoch, samples_consumed=self._consumed, seed=self.dataset.seed,
                           manifest_digest=self.dataset.manifest.digest,
                           skipped_shards=tuple(sorted(self._skipped)))

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint (see the module docstring)."""
        return self.loader_state().to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` left off. Raises ResumeMismatchError for another manifest unless
        ``allow_manifest_change`` is set; the saved seed replaces the constructor's."""
        loaded = LoaderState.from_dict(state)
        digest = self.dataset.manifest.digest
        if loaded.manifest_digest != digest:
            if not self.allow_manifest_change:
                raise ResumeMismatchError(
                    f"the checkpoint's data state was made with dataset manifest {loaded.manifest_digest}, "
                    f"but this loader reads manifest {digest}",
                    hint="resume with the original manifest, or pass allow_manifest_change=True to "
                         "ShardLoader to keep the position with the new data")
            log.warning("resuming data state of manifest %s with manifest %s", loaded.manifest_digest, digest)
        if loaded.seed != self.dataset.seed:
            log.info("data loader seed %d replaced by the checkpoint's seed %d", self.dataset.seed, loaded.seed)
            self.dataset.seed = loaded.seed
        self._epoch, self._consumed = loaded.epoch, loaded.samples_consumed
        self._skipped = set(loaded.skipped_shards)
