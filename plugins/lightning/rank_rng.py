"""Every rank's random number generators in a Lightning checkpoint, and each rank's own back on resume.

Lightning calls a ``CheckpointIO`` on global rank 0 only, so the RNG states ckptd captures with a save are
rank 0's. The other ranks draw their own numbers (dropout masks seeded per rank, random augmentation), and
after a resume they would draw from wherever their generators happen to be. :class:`CkptdRankRNG` is a
Lightning callback whose ``state_dict`` runs on every rank while Lightning builds the checkpoint: it
gathers every rank's states (torch CPU and CUDA, numpy, ``random``) into the checkpoint's ``callbacks``
entry, and its ``load_state_dict`` gives each rank its own states back on resume.

A checkpoint saved in the middle of an epoch also holds the states each rank had when the epoch's loader
iterator was created, so that a resume creates its iterator from the same states (see
:meth:`CkptdRankRNG.on_fit_start`). The training loader's own position is Lightning's business: its loops
save the ``state_dict()`` of a loader that has one (torchdata's ``StatefulDataLoader``, ckptd's
:class:`~ckptd.plugins.lightning.LightningShardLoader`) and ckptd saves it with the step. At each save,
global rank 0 warns once per loader whose position a mid-epoch resume cannot continue from: a plain
``DataLoader`` (through :func:`ckptd.data.warn_unresumable_loader`), or under DDP a stateful
loader whose sampler does not save its epoch (see :mod:`ckptd.plugins.lightning.sampler`).

It is added to every ``Trainer`` through Lightning's ``lightning.pytorch.callbacks_factory`` entry point
(:func:`lightning_callbacks`); do not add it yourself. It does nothing (and adds nothing to the
checkpoint) unless the trainer's ``CheckpointIO`` is a :class:`CkptdCheckpointIO` with ``capture_rng``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, DistributedSampler

from ckptd import capture_rng_states, restore_rng_states
from ckptd.plugins.lightning.checkpoint_io import CkptdCheckpointIO
from ckptd.plugins.lightning.loading import install as install_pointer_loading
from ckptd.data import describe_loader, first_warning_for, has_position, warn_unresumable_loader

log = logging.getLogger("ckptd.plugins.lightning")


def _ckptd_io(trainer: Any) -> CkptdCheckpointIO | None:
    """The trainer's CkptdCheckpointIO, also inside a wrapping CheckpointIO (``AsyncCheckpointIO``)."""
    io = getattr(trainer.strategy, "checkpoint_io", None)
    for _ in range(8):
        if isinstance(io, CkptdCheckpointIO) or io is None:
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _inside_an_epoch(trainer: Any) -> bool:
    """Whether the trainer is fitting and has taken some but not all of its epoch's training batches (a save
    at a validation inside the epoch included)."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return False
    taken = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return 0 < taken < trainer.num_training_batches


def sampler_order_lost(loader: Any) -> str | None:
    """Why a resume of ``loader`` (a loader with a position) under DDP takes another order than the epoch's,
    None when it does not: Lightning creates a resumed iterator before it sets the sampler's epoch."""
    sampler = getattr(loader, "sampler", None)
    fix = "pass sampler=ResumableDistributedSampler(dataset) (ckptd.plugins.lightning) in place of shuffle=True"
    if isinstance(sampler, DistributedSamplerWrapper):
        return (f"Lightning wrapped its sampler into a DistributedSamplerWrapper, which draws a new order from the "
                f"global RNG whenever an iterator starts (twice on a resume); {fix}")
    if isinstance(sampler, DistributedSampler) and sampler.shuffle and not (
            has_position(sampler) and "epoch" in sampler.state_dict()):
        return (f"its {type(sampler).__name__} saves no epoch, so a resume after the first epoch fast-forwards "
                f"through the first epoch's order; {fix}")
    return None


def warn_inexact_loaders(trainer: Any) -> None:
    """Warn once per training loader whose position a resume in the middle of an epoch cannot continue from."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return
    for index, loader in enumerate(CombinedLoader(loaders).flattened):
        name = "train_dataloader" if index == 0 else f"train_dataloader[{index}]"
        if isinstance(loader, DataLoader) and not has_position(loader):
            warn_unresumable_loader(loader, name)
        elif trainer.world_size > 1 and (why := sampler_order_lost(loader)) is not None \
                and first_warning_for(loader):
            log.warning("data loader %r, %s: %s. Its position is saved, but a resume in the middle of an epoch "
                        "continues in another order than the uninterrupted run's.", name, describe_loader(loader),
                        why)


class CkptdRankRNG(Callback):
    """Saves every rank's RNG states with a ckptd checkpoint and restores each rank's own (see the module
    docstring). ``state_dict`` is collective under DDP: Lightning calls it on every rank at every save."""

    def __init__(self) -> None:
        self._active = False
        self._trainer: Any = None
        self._first_epoch: int | None = None  # the epoch this fit trained first (its iterator: setup_data's)
        self._at_fit_start: dict[str, Any] | None = None
        self._at_epoch_start: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None  # this rank's states of a mid-epoch checkpoint, to re-apply

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = _ckptd_io(trainer)
        self._active = io is not None and io.capture_rng
        self._trainer = trainer

    def _gathered(self, mine: dict[str, Any]) -> list[Any]:
        world = _group_size()
        if world == 1:
            return [mine]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        return gathered

    def state_dict(self) -> dict[str, Any]:
        if not self._active:
            return {}
        state: dict[str, Any] = {"world_size": _group_size(), "ranks": self._gathered(capture_rng_states())}
        trainer = self._trainer
        if _inside_an_epoch(trainer):
            first = self._first_epoch is None or trainer.current_epoch == self._first_epoch
            state["epoch_start_ranks"] = self._gathered((self._at_fit_start if first else self._at_epoch_start)
                                                        or capture_rng_states())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._active:  # capture_rng=False (or another CheckpointIO) now: the generators stay as they are
            return
        ranks = state_dict.get("ranks") or []
        world, rank = _group_size(), dist.get_rank() if _group_size() > 1 else 0
        if len(ranks) != world:
            log.warning("the checkpoint holds the RNG states of %d ranks and this job has %d: the ranks' "
                        "generators are not restored (rank 0's are, with the checkpoint)", len(ranks), world)
            return
        restore_rng_states(ranks[rank])
        epoch_start = state_dict.get("epoch_start_ranks")
        if epoch_start:
            restore_rng_states(epoch_start[rank])
            self._loaded = ranks[rank]
        # what the resumed iterator is created from (on_fit_start captures it too, unless a strategy restores
        # the checkpoint after that hook)
        self._at_fit_start = epoch_start[rank] if epoch_start else ranks[rank]

    # The training loader's iterator draws from the global generators when it is created (its base seed,
    # the permutation of a sampler without a generator of its own): at the epoch's start in an uninterrupted
    # run, in setup_data (after on_fit_start) in a resumed one. A checkpoint saved inside an epoch therefore
    # also holds the states the epoch's iterator was created from; a resume creates its iterator from those,
    # then continues from the states of the save (on_train_start, before the first batch is trained).
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._first_epoch, self._at_epoch_start = None, None
        self._at_fit_start = capture_rng_states() if self._active else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            restore_rng_states(loaded)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._active:
            self._at_epoch_start = capture_rng_states()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._first_epoch is None:
            self._first_epoch = trainer.current_epoch

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._active and trainer.is_global_zero and trainer.state.fn == TrainerFn.FITTING:
            warn_inexact_loaders(trainer)


def lightning_callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the callbacks ckptd adds to every Trainer
    (and ``Model.load_from_checkpoint`` made able to read ckptd pointers, see
    :mod:`ckptd.plugins.lightning.loading`)."""
    install_pointer_loading()
    return [CkptdRankRNG()]
