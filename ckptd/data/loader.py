"""ShardLoader: a DataLoader over a ShardDataset whose state is part of the checkpoint.

The state is (epoch, global samples consumed, seed, manifest digest) plus the shards skipped under
``on_corrupt="skip"`` and the step it was saved for. The position saved is that of the next batch the
training loop will *train on*, not the next one it will *take*: :class:`ckptd.CheckpointManager` hands
the step it saves to :meth:`ShardLoader.state_dict_for_step`, which maps it to a batch by the
convention of :mod:`ckptd.data.position` (the step counts the training steps done; ``batches_per_step``
micro-batches each; ``start_step`` for loops that number otherwise). Batches the loop took ahead (the
next batch fetched before the save, a prefetcher's queue) are therefore not lost, and a save whose step
does not fit the batches taken raises :class:`~ckptd.errors.LoaderPositionError`. The position is
global, so a resume is exact with any world size or worker count.

Call order: construct (before or after the process group exists: the dataset takes its rank and world
size when an iteration starts, see :meth:`ShardDataset.bind`); optionally :meth:`load_state_dict` (or
``CheckpointManager.restore``); iterate.
Without ``steps``, one iteration runs from the current position to the end of the epoch, then the state
moves to the start of the next epoch; with ``steps=N`` one iteration runs across epochs until the run
has taken ``N * batches_per_step`` batches in all. Iterating from the main thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from ckptd.data.dataset import RankBatch, ShardDataset
from ckptd.data.position import BatchLedger, Position, StepConvention, held_changed
from ckptd.data.worker_fork import workers_leave_inherited_objects_alone
from ckptd.errors import ConfigError, ResumeMismatchError

log = logging.getLogger("ckptd.data")

#: Version of the loader state layout (1: without the saved step; still read).
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class LoaderState:
    """Where a ShardLoader stands; its JSON form is what the checkpoint holds.

    ``step``: the training step the state was saved for (None when saved by plain ``state_dict()``,
    which records the position after the last batch handed out). ``held``: batches the loop had taken
    but not trained on at that save and ``start_step`` the loader's argument then (None without a step).
    """

    epoch: int
    samples_consumed: int
    seed: int
    manifest_digest: str
    skipped_shards: tuple[str, ...] = ()
    step: int | None = None
    held: int | None = None
    start_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.epoch, "samples_consumed": self.samples_consumed,
                "seed": self.seed, "manifest_digest": self.manifest_digest,
                "skipped_shards": list(self.skipped_shards), "step": self.step, "held": self.held,
                "start_step": self.start_step}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoaderState:
        if raw.get("version") not in _READABLE_VERSIONS:
            raise ResumeMismatchError(f"data loader state version {raw.get('version')!r} is not supported "
                                      f"(expected one of {_READABLE_VERSIONS})",
                                      hint="resume with the ckptd that saved it")
        try:
            step, held, start_step = raw.get("step"), raw.get("held"), raw.get("start_step")
            state = cls(epoch=int(raw["epoch"]), samples_consumed=int(raw["samples_consumed"]),
                        seed=int(raw["seed"]), manifest_digest=str(raw["manifest_digest"]),
                        skipped_shards=tuple(str(path) for path in raw.get("skipped_shards") or ()),
                        step=None if step is None else int(step), held=None if held is None else int(held),
                        start_step=None if start_step is None else int(start_step))
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

    ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``multiprocessing_context`` and
    ``worker_init_fn`` go to the DataLoader (workers are started for each epoch). ``batches_per_step``
    (micro-batches per training step, for gradient accumulation), ``start_step`` (the step number a save
    before any training would carry; 0 when the step you save counts the steps done) and ``max_ahead``
    (batches a loop may hold untrained at a save) map saved steps to batches, see
    :mod:`ckptd.data.position`; the first save after a resume warns when the loop holds another number of
    untrained batches than at the save it resumed from (a numbering that needs ``start_step``). ``steps=N`` runs one
    iteration across epochs for N training steps in all (the epoch is in the state).
    ``with_sample_ids=True`` yields ``(batch, ids)`` with the ``"<shard path>#<index>"`` of each sample.
    ``allow_manifest_change=True`` lets :meth:`load_state_dict` accept a state saved with another
    manifest (the position is kept, the samples behind it differ).
    """

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, multiprocessing_context: Any = None,
                 worker_init_fn: Callable[[int], None] | None = None, batches_per_step: int = 1,
                 start_step: int = 0, max_ahead: int | None = None,
                 steps: int | None = None, with_sample_ids: bool = False,
                 allow_manifest_change: bool = False) -> None:
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        if steps is not None and steps < 0:
            raise ConfigError(f"steps must be >= 0, got {steps}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.worker_init_fn = worker_init_fn
        self.convention = StepConvention(batches_per_step, start_step, max_ahead)
        self.steps = steps
        self.with_sample_ids = with_sample_ids
        self.allow_manifest_change = allow_manifest_change
        self._epoch = 0
        self._consumed = 0
        self._skipped: set[str] = set()
        self._ledger = BatchLedger(self.convention, start_step, Position(0, 0))
        self._held_at_restore: int | None = None

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

    @property
    def batches_taken(self) -> int:
        """Batches of the whole run handed to the training loop: epochs done times batches per epoch,
        plus the batches of the current epoch."""
        return self._global_batch(Position(self._epoch, self._consumed))

    def _global_batch(self, position: Position) -> int:
        return position.epoch * self.dataset.steps_in_epoch(0) + \
            position.samples_consumed // self.dataset.schedule.global_batch_size

    def __len__(self) -> int:
        """Batches the next iteration yields: those left in the epoch, or, with ``steps``, in the run."""
        if self.steps is None:
            return self.dataset.steps_in_epoch(self._consumed)
        return max(self._batch_limit() - self.batches_taken, 0)

    def _batch_limit(self) -> int:
        return (self.steps or 0) * self.convention.batches_per_step

    # --- iteration -----------------------------------------------------------------------------
    def _data_loader(self) -> DataLoader:  # type: ignore[type-arg]
        options: dict[str, Any] = {}
        if self.num_workers:
            options["multiprocessing_context"] = self.multiprocessing_context
            options["worker_init_fn"] = self.worker_init_fn
            if self.prefetch_factor is not None:
                options["prefetch_factor"] = self.prefetch_factor
        # Starting a DataLoader iterator draws a base seed from the global torch RNG unless it has its own
        # generator; that extra draw at a resume would shift every later random number of the training.
        generator = torch.Generator().manual_seed(self.dataset.seed * 1_000_003 + self._epoch)
        return DataLoader(self.dataset, batch_size=None, collate_fn=_unwrapped, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, generator=generator, **options)

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches from the current position to the end of the epoch (with ``steps``: to the
        end of the run, across epochs)."""
        if self.steps is None:
            yield from self._epoch_batches()
            return
        if self.dataset.steps_in_epoch(0) == 0 and self._batch_limit() > 0:
            raise ConfigError(f"the dataset holds fewer samples than one global batch of "
                              f"{self.dataset.schedule.global_batch_size}: steps={self.steps} would never end",
                              hint="use a smaller global_batch_size or more data")
        while self.batches_taken < self._batch_limit():
            yield from self._epoch_batches()

    def _epoch_batches(self) -> Iterator[Any]:
        self.dataset.bind()  # here, not at construction: a loader built before the process group exists
        self.dataset.set_position(self._epoch, self._consumed, frozenset(self._skipped),
                                  sample_ids=self.with_sample_ids)
        batch_size = self.dataset.schedule.global_batch_size
        with workers_leave_inherited_objects_alone():
            batches = iter(self._data_loader())  # forks the workers
        for item in batches:
            item = item.finished()  # already done by the pinning thread with pin_memory=True
            if item.epoch != self._epoch:
                raise ResumeMismatchError(f"a worker produced a batch of epoch {item.epoch} during epoch "
                                          f"{self._epoch}", hint="do not change the loader while iterating")
            self._ledger.handed(Position(item.epoch, item.end_position - batch_size))
            self._consumed = item.end_position
            self._skipped.update(item.newly_skipped)
            yield (item.batch, list(item.sample_ids or ())) if self.with_sample_ids else item.batch
            if self.steps is not None and self.batches_taken >= self._batch_limit():
                return
        self._epoch += 1
        self._consumed = 0

    # --- checkpoint state ----------------------------------------------------------------------
    def loader_state(self, step: int | None = None) -> LoaderState:
        """The state to save: for ``step``, the position the steps after it start from (raises
        LoaderPositionError when ``step`` does not fit the batches handed out); without a step, the
        position after the last batch handed out."""
        position, held = Position(self._epoch, self._consumed), None
        if step is not None:
            position = self._ledger.position_for(step, position, what=self._describe())
            held = self._ledger.held(step)
            if self._held_at_restore is not None and step > self._ledger.origin_step:
                warning = held_changed(self.convention, self._ledger.origin_step, self._held_at_restore, step,
                                       held, self._describe())
                self._held_at_restore = None
                if warning is not None:
                    log.warning("%s", warning)
        return LoaderState(epoch=position.epoch, samples_consumed=position.samples_consumed,
                           seed=self.dataset.seed, manifest_digest=self.dataset.manifest.digest,
                           skipped_shards=tuple(sorted(self._skipped)), step=step, held=held,
                           start_step=None if step is None else self.convention.start_step)

    def _describe(self) -> str:
        return f"the data loader of rank {self.dataset.schedule.rank}"

    def state_dict_for_step(self, step: int) -> dict[str, Any]:
        """JSON-able state of a checkpoint of training step ``step``: the position of the first batch the
        steps after ``step`` consume. :class:`ckptd.CheckpointManager` calls this when it saves."""
        return self.loader_state(step).to_dict()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state at the position after the last batch handed out (right for a loop that
        trains every batch it takes before it saves; a manager's save uses :meth:`state_dict_for_step`)."""
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
        position = Position(loaded.epoch, loaded.samples_consumed)
        step = loaded.step
        if step is None:  # saved without a step: the batches taken then count the steps done
            step = self.convention.start_step + self._global_batch(position) // self.convention.batches_per_step
        self._ledger = BatchLedger(self.convention, step, position)
        # A start_step changed since that save (the fix the warning asks for) makes the counts incomparable.
        self._held_at_restore = loaded.held if loaded.start_step == self.convention.start_step else None
