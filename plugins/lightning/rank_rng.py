"""Every rank's random number generators in a Lightning checkpoint, and each rank's own back on resume.

Lightning calls a ``CheckpointIO`` on global rank 0 only, so the RNG states ckptd captures with a save are
rank 0's. The other ranks draw their own numbers (dropout masks seeded per rank, random augmentation), and
after a resume they would draw from wherever their generators happen to be. :class:`CkptdRankRNG` is a
Lightning callback whose ``state_dict`` runs on every rank while Lightning builds the checkpoint: it
gathers every rank's states (torch CPU and CUDA, numpy, ``random``) into the checkpoint's ``callbacks``
entry, and its ``load_state_dict`` gives each rank its own states back on resume.

It is added to every ``Trainer`` through Lightning's ``lightning.pytorch.callbacks_factory`` entry point
(:func:`lightning_callbacks`); do not add it yourself. It does nothing (and adds nothing to the
checkpoint) unless the trainer's ``CheckpointIO`` is a :class:`CkptdCheckpointIO` with ``capture_rng``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ckptd import capture_rng_states, restore_rng_states
from ckptd.plugins.lightning.checkpoint_io import CkptdCheckpointIO

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


class CkptdRankRNG(Callback):
    """Saves every rank's RNG states with a ckptd checkpoint and restores each rank's own (see the module
    docstring). ``state_dict`` is collective under DDP: Lightning calls it on every rank at every save."""

    def __init__(self) -> None:
        self._active = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = _ckptd_io(trainer)
        self._active = io is not None and io.capture_rng

    def state_dict(self) -> dict[str, Any]:
        if not self._active:
            return {}
        mine = capture_rng_states()
        world = _group_size()
        if world == 1:
            return {"world_size": 1, "ranks": [mine]}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        return {"world_size": world, "ranks": gathered}

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


def lightning_callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the callbacks ckptd adds to every Trainer."""
    return [CkptdRankRNG()]
