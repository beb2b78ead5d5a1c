"""Which ranks hold each tensor of a state identically, and which one of them writes it.

A tensor is held identically by several ranks when it is a DTensor with ``Replicate`` placements (every
rank along those mesh dimensions holds the same local shard) or a plain tensor under a key the
:class:`~ckptd.format.mesh_layout.Layout` marks as replicated across some mesh dimensions (DDP: every
``dp`` rank holds the same weights). :func:`holders_of` finds the holders of every tensor of a flattened
state; :func:`plan_writers` picks one writer per replicated piece.

The plan needs no communication: the holders of one piece all hold the same pieces of their group (same
names, same sizes), so each computes the same assignment from them alone. Within a group the pieces go,
largest first, to the holder with the fewest bytes assigned so far (ties: an order rotated by a digest of
the group, so that ties do not always land on the group's lowest rank). The busiest holder then writes at
most the group's mean plus its largest piece: within 1.25x the mean when no piece exceeds a quarter of the
mean (pieces are whole tensors, never split). A rank writes the sum over its groups, each balanced alone,
and the pieces only it holds. Holders that differ in names, dtypes or shapes are refused at commit
(:meth:`~ckptd.manager.holdings.Holdings.manifest`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ckptd.format.mesh_layout import Layout
from ckptd.state import rng


@dataclass(frozen=True)
class WritePlan:
    """Who writes what, as one rank sees it: the writer of every piece it holds with other ranks."""

    rank: int
    #: Tensor name -> every holder's rank, for the pieces held by more than this rank.
    holders: dict[str, tuple[int, ...]]
    #: Tensor name -> the rank that writes it, for the same pieces.
    writers: dict[str, int]

    def writes(self, name: str) -> bool:
        """Whether this rank writes the tensor ``name``."""
        return self.writers.get(name, self.rank) == self.rank

    @property
    def replicas(self) -> dict[str, int]:
        """Pieces this rank holds but another rank writes: name -> writer."""
        return {name: writer for name, writer in self.writers.items() if writer != self.rank}

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Pieces this rank writes that other ranks hold too: name -> holders."""
        return {name: self.holders[name] for name, writer in self.writers.items() if writer == self.rank}


def dtensor_holders(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The global ranks holding the same local shard as this rank, for a DTensor; None for other tensors."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:
        return None
    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    index = tuple(slice(None) if isinstance(p, Replicate) else coordinate[axis]
                  for axis, p in enumerate(tensor.placements))
    return tuple(sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist()))


def _top_key(name: str) -> str:
    return name.split("/", 1)[0].replace("%2F", "/").replace("%25", "%")


def holders_of(tensors: Mapping[str, torch.Tensor], *, rank: int, layout: Layout | None) -> dict[str, tuple[int, ...]]:
    """The holders of every tensor held by more than this rank (see the module docstring). ckptd's RNG
    states are never replicated (each rank has its own)."""
    found: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        holders = dtensor_holders(tensor)
        if holders is None and layout is not None and _top_key(name) != rng.RNG_KEY:
            dims = layout.replicated_dims(_top_key(name))
            holders = layout.holders(rank, dims) if dims else None
        if holders is not None and len(holders) > 1:
            found[name] = holders
    return found


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a DTensor's local shard, any other tensor itself."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return tensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_part(tensor)
    return local.numel() * local.element_size()


def plan_writers(tensors: Mapping[str, torch.Tensor], holders: Mapping[str, tuple[int, ...]], *,
                 rank: int) -> WritePlan:
    """One writer per replicated piece, balanced by bytes within each group of holders."""
    groups: dict[tuple[int, ...], list[tuple[int, str]]] = defaultdict(list)
    for name, group in holders.items():
        groups[group].append((_nbytes(tensors[name]), name))
    writers: dict[str, int] = {}
    for group, pieces in groups.items():
        turn = xxhash.xxh3_64_intdigest(",".join(map(str, group)).encode()) % len(group)
        order = {member: (i - turn) % len(group) for i, member in enumerate(group)}
        load = dict.fromkeys(group, 0)
        for size, name in sorted(pieces, key=lambda piece: (-piece[0], piece[1])):
            chosen = min(group, key=lambda member: (load[member], order[member]))
            writers[name] = chosen
            load[chosen] += size
    return WritePlan(rank=rank, holders=dict(holders), writers=writers)


def mesh_of_state(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], tuple[int, ...]] | None:
    """The device mesh of the state's DTensors (the one with the most dimensions; for a sub-mesh such as a
    pipeline stage's ``mesh["dp"]``, the mesh it was cut from, so that every rank has its own coordinates)
    as name -> size, and this rank's coordinates in it; None when the state holds no DTensor. Unnamed
    dimensions are ``dim<i>``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    best = None
    for tensor in tensors.values():
        if not isinstance(tensor, DTensor):
            continue
        mesh = tensor.device_mesh
        root = getattr(mesh, "_get_root_mesh", None)  # private in torch 2.x: the sub-mesh itself without it
        mesh = (root() if callable(root) else None) or mesh
        if best is None or mesh.ndim > best.ndim:
            best = mesh
    if best is None or best.get_coordinate() is None:
        return None
    names = best.mesh_dim_names or tuple(f"dim{i}" for i in range(best.ndim))
    return dict(zip(names, (int(s) for s in best.mesh.shape))), tuple(int(c) for c in best.get_coordinate())


def placement_codes(tensor: torch.Tensor) -> str | None:
    """A DTensor's placements as a short text (``"R,S0"``: Replicate on the first mesh dimension, Shard(0)
    on the second; ``P``: partial), None for other tensors."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        return None
    if not isinstance(tensor, DTensor):
        return None
    return ",".join("R" if isinstance(p, Replicate) else f"S{p.dim}" if isinstance(p, Shard) else "P"
                    for p in tensor.placements)

