"""``ResumableDistributedSampler``: a shuffling ``DistributedSampler`` whose saved state holds its epoch.

Under DDP, Lightning puts a ``DistributedSampler`` into the training loader (or, for a loader whose sampler is
not torch's own ``RandomSampler``, such as torchdata's ``StatefulDataLoader(shuffle=True)``, a
``DistributedSamplerWrapper`` that draws a new order from the global RNG each time an iterator starts). On a
resume, Lightning creates the loader's iterator before it sets the sampler's epoch, so a
``StatefulDataLoader`` that fast-forwards its sampler to the saved position does so in another order than
the epoch's: the resume is exact only in the first epoch, or not at all with the wrapper. This sampler is
torchdata's ``StatefulDistributedSampler`` with the epoch in its state: the loader's state (which Lightning
saves with its loops, and ckptd with the step) brings back both the epoch and the position. Pass it as the
loader's ``sampler`` instead of ``shuffle=True``; Lightning then leaves it in place.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` whose state holds its epoch (see the module docstring).

    ``num_replicas`` and ``rank`` default to the process group's, or 1 and 0 without one (one process).
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if grouped else 1
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "epoch" in state_dict:
            self.set_epoch(int(state_dict["epoch"]))
