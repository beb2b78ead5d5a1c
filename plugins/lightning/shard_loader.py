"""``LightningShardLoader``: ckptd's :class:`~ckptd.data.ShardLoader` with the length Lightning counts on.

Lightning reads a training loader's ``len()`` once, as the batches of a whole epoch, and then takes
exactly that many batches per epoch: it never asks the iterator for the one after the last, and after a
resume in the middle of an epoch it counts the batches already trained towards the same length. A
:class:`~ckptd.data.ShardLoader` reports the batches left from its position and moves to the next epoch
when its iteration runs to the end. This subclass reports the batches of a whole epoch and runs each
iteration to its end as it hands out the epoch's last batch, so the position (saved by Lightning through
``state_dict()`` with its loops) moves to the next epoch before Lightning takes no further batch. Use it as
the data module's ``train_dataloader()``, with ShardLoader's arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptd.data import ShardLoader
from ckptd.errors import LoaderPositionError


class LightningShardLoader(ShardLoader):
    """A :class:`~ckptd.data.ShardLoader` for Lightning's training loop (see the module docstring)."""

    def __len__(self) -> int:
        """Batches of one whole epoch (with ``steps``: of the whole run), wherever the position is."""
        if self.steps is None:
            return self.dataset.steps_in_epoch(0)
        return self.steps * self.convention.batches_per_step

    def __iter__(self) -> Iterator[Any]:
        left = super().__len__()
        batches = super().__iter__()
        for taken, batch in enumerate(batches, start=1):
            if taken == left:
                for _ in batches:  # the iteration's end moves the position to the next epoch
                    raise LoaderPositionError(f"the data loader of rank {self.dataset.schedule.rank} yielded more "
                                              f"than the {left} batches it announced",
                                              hint="do not change the loader while iterating")
            yield batch
