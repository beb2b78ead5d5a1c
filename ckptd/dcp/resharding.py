"""Restoring a CheckpointManager step into a different world size, through DCP.

Tensors that were sharded when saved (DTensor shards, recorded in the index's ``shards``) are loaded
with ``torch.distributed.checkpoint.load`` and ckptd's reader, so DCP's planner works out which stored
regions each new rank needs. Everything else (plain tensors, RNG states, JSON values) belongs to one
rank: new rank ``r`` takes the share of saved rank ``r`` when it existed, else of saved rank 0.

Call on every rank of the new job, from the training thread, with the same step: ``dcp.load`` issues
collectives on the default process group (without a process group, a single process loads alone).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from ckptd.format.values import manager_skeleton, parse_values
from ckptd.state.live_reader import TensorReader, live_reader
from ckptd.state.tree import flatten, skeleton_tensor_names
from ckptd.tiers.base import StorageTier

__all__ = ["TensorReader", "live_reader", "resharded_source"]


def resharded_source(tiers: list[StorageTier], step: int, live: MutableMapping[str, Any], *, rank: int,
                     allow_pickle: bool) -> tuple[Any, TensorReader]:
    """The skeleton this rank restores and a tensor reader for it; loads sharded tensors through DCP.

    ``live`` is the state being restored into (used to load shards in place into live DTensors).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptd.dcp.reader import CkptdStorageReader

    reader = CkptdStorageReader(list(tiers), step, allow_pickle=allow_pickle)
    reader.read_metadata()
    saved_world = reader.manifest.world_size  # type: ignore[union-attr]
    own = reader.step_reader(rank if rank < saved_world else 0)
    values = parse_values(own.index.values)
    skeleton = manager_skeleton(values, step=step)
    live_tensors = flatten(dict(live), allow_pickle=True).tensors
    targets: dict[str, torch.Tensor] = {}
    for name in skeleton_tensor_names(skeleton):
        if name not in values.shards:
            continue
        fqn, placement = values.shards[name]
        candidate = live_tensors.get(name)
        dtype = own.record(name).torch_dtype
        if candidate is not None and tuple(candidate.shape) == placement.global_shape and candidate.dtype == dtype:
            targets[fqn] = candidate
        else:
            targets[fqn] = torch.empty(placement.global_shape, dtype=dtype)
    dcp.load(targets, storage_reader=CkptdStorageReader(list(tiers), step, allow_pickle=allow_pickle),
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))

    unsharded = live_reader(own.read_tensor)

    def read(name: str, out: torch.Tensor | None) -> torch.Tensor:
        if name not in values.shards:
            return unsharded(name, out)
        loaded = targets[values.shards[name][0]]
        if out is None or out is loaded:
            return loaded
        with torch.no_grad():
            out.copy_(loaded)
        return out

    return skeleton, read

