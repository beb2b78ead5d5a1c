"""Which ranks hold each tensor of a state identically, and which one of them writes it.

A tensor is held identically by several ranks when it is a DTensor with ``Replicate`` placements (every
rank along those mesh dimensions holds the same local shard) or a plain tensor under a key the
:class:`~ckptd.format.mesh_layout.Layout` marks as replicated across some mesh dimensions (DDP: every
``dp`` rank holds the same weights). :func:`holders_of` finds the holders of every tensor of a flattened
state; :func:`plan_writers` picks one writer per replicated piece.

The plan is balanced job-wide and needs no communication: every rank computes the same assignment from
what it can describe of the whole job (:func:`job_scopes`):

- a DTensor is held by every rank of its device mesh, and its global shape, dtype and placements say the
  size of every rank's local shard and which ranks hold each shard identically: a rank describes every
  piece of it on the whole mesh, its unique shards (written by their one holder) included;
- a plain tensor under a :class:`~ckptd.format.mesh_layout.Layout`'s replicated dimensions is described
  by its holders only (the holders of one piece hold the same pieces of their group, same names and sizes);
  plain tensors held by one rank are known to that rank only and take no part.

Pieces are pooled in *scopes*: the ranks of a DTensor's mesh, or a plain piece's group of holders; every
rank of a scope describes all of its pieces alike. Scopes are planned largest first; within one, the
replicated pieces go, largest first, to the holder with the fewest bytes so far (ties: an order rotated by
a digest of the holders, so that ties do not always land on the lowest rank), counting the bytes each rank
writes for the scopes planned before that contain this one (which every rank of it knows) and the scope's
unique shards. A pass then moves pieces off the busiest rank while that lowers the busiest rank's bytes.
On the DP x TP layouts of issue 32 the busiest rank writes at most 1.15x the mean (or what the largest
piece allows). The assignment depends only on the described pieces, so it is cached per state shape.

``job_wide=False`` balances each group of holders alone (each rank then writes at most its groups' means
plus their largest pieces): ``write_replicas="once-per-directory"`` uses it, since a rank there does not
know how the other directories are grouped. Holders that differ in names, dtypes or shapes are refused
at commit (:meth:`~ckptd.manager.holdings.Holdings.manifest`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True, order=True)
class Piece:
    """One piece of the job's state as every rank of its scope describes it: its tensor's name, the ranks
    holding it identically (one rank: a unique shard) and its bytes."""

    name: str
    holders: tuple[int, ...]
    nbytes: int


#: Ranks that all describe the same pieces (a DTensor's mesh, or a plain piece's holders) -> those pieces.
Scopes = dict[tuple[int, ...], tuple[Piece, ...]]


def _local_shape(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                 placements: Sequence[Any]) -> tuple[int, ...]:
    """The local shard's shape at ``coordinate`` of a mesh, as DTensor computes it."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError:  # private in torch 2.x: the same rule (torch.chunk's sizes per Shard, in mesh order)
        from torch.distributed.tensor import Shard

        shape = list(global_shape)
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard):
                size, parts = shape[placement.dim], mesh_shape[axis]
                chunk = -(-size // parts) if size else 0
                shape[placement.dim] = max(0, min(chunk, size - chunk * coordinate[axis]))
        return tuple(shape)
    shape, _ = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements,
                                                      skip_offset=True)
    return tuple(int(s) for s in shape)


def describe_dtensor(name: str, global_shape: Sequence[int], element_size: int, placements: Sequence[Any],
                     mesh_ranks: Sequence[Any]) -> tuple[Piece, ...]:
    """Every piece of a DTensor on its whole mesh: one per local shard, with the ranks that hold it
    identically (all ranks along its ``Replicate`` dimensions) and its bytes. ``mesh_ranks``: the mesh as
    nested lists of global ranks (``device_mesh.mesh.tolist()``)."""
    return tuple(Piece(name, holders, nbytes)
                 for holders, nbytes in _shards(tuple(int(s) for s in global_shape), element_size,
                                                tuple(placements), mesh_ranks))


@functools.lru_cache(maxsize=256)
def _mesh_shards(global_shape: tuple[int, ...], element_size: int, placements: tuple[Any, ...],
                 mesh: Any) -> tuple[tuple[tuple[int, ...], int], ...]:
    """:func:`_shards` of a DTensor on ``mesh`` (a DeviceMesh), computed once per shape, placements and mesh
    (the layers of a model share a few shapes)."""
    return _shards(global_shape, element_size, placements, mesh.mesh.tolist())


def _shards(global_shape: tuple[int, ...], element_size: int, placements: tuple[Any, ...],
            mesh_ranks: Any) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(holders, bytes) of every local shard of a DTensor; see :func:`describe_dtensor`."""
    from torch.distributed.tensor import Replicate

    mesh_shape: list[int] = []
    level: Any = mesh_ranks
    while isinstance(level, (list, tuple)):
        mesh_shape.append(len(level))
        level = level[0] if level else None
    replicated = [axis for axis, p in enumerate(placements) if isinstance(p, Replicate)]
    others = [axis for axis in range(len(mesh_shape)) if axis not in replicated]
    shape = global_shape
    pieces = []
    for projection in itertools.product(*(range(mesh_shape[axis]) for axis in others)):
        coordinate = [0] * len(mesh_shape)
        for axis, value in zip(others, projection):
            coordinate[axis] = value
        holders = []
        for spread in itertools.product(*(range(mesh_shape[axis]) for axis in replicated)):
            for axis, value in zip(replicated, spread):
                coordinate[axis] = value
            cell: Any = mesh_ranks
            for value in coordinate:
                cell = cell[value]
            holders.append(int(cell))
        local = _local_shape(shape, tuple(mesh_shape), tuple(coordinate), placements)
        pieces.append((tuple(sorted(holders)), math.prod(local) * element_size))
    return tuple(pieces)


#: What a plan depends on, per tensor: (name, holders or None, local bytes, global shape, element size,
#: placements, device mesh); the last four are None for a plain tensor.
_Entry = tuple[str, "tuple[int, ...] | None", int, Any, int, Any, Any]


def _entries(tensors: Mapping[str, torch.Tensor], holders: Mapping[str, tuple[int, ...]],
             job_wide: bool) -> tuple[_Entry, ...]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = None  # type: ignore[assignment,misc]
    entries = []
    for name in sorted(tensors):
        tensor, group = tensors[name], holders.get(name)
        if job_wide and DTensor is not None and isinstance(tensor, DTensor) \
                and tensor.device_mesh.get_coordinate() is not None:
            entries.append((name, group, _nbytes(tensor), tuple(int(s) for s in tensor.shape),
                            tensor.dtype.itemsize, tuple(tensor.placements), tensor.device_mesh))
        elif group is not None:
            entries.append((name, group, _nbytes(tensor), None, 0, None, None))
    return tuple(entries)


def _scopes(entries: tuple[_Entry, ...]) -> Scopes:
    scopes: dict[tuple[int, ...], set[Piece]] = defaultdict(set)
    for name, group, nbytes, shape, element_size, placements, mesh in entries:
        if mesh is not None:
            shards = _mesh_shards(shape, element_size, placements, mesh)
            if group is None or any(holders == group for holders, _ in shards):
                scope = tuple(sorted({r for holders, _ in shards for r in holders}))
                scopes[scope].update(Piece(name, holders, nbytes) for holders, nbytes in shards)
                continue
        if group is not None:
            scopes[group].add(Piece(name, group, nbytes))
    return {scope: tuple(sorted(pieces, key=_piece_order)) for scope, pieces in scopes.items()}


def _piece_order(piece: Piece) -> tuple[str, tuple[int, ...], int]:
    return piece.name, piece.holders, piece.nbytes


def job_scopes(tensors: Mapping[str, torch.Tensor], holders: Mapping[str, tuple[int, ...]], *,
               job_wide: bool = True) -> Scopes:
    """What this rank can describe of the job's pieces, by scope (see the module docstring). With
    ``job_wide=False``, or for a DTensor whose described holders differ from ``holders``, a replicated
    piece is described alone, in the scope of its holders."""
    return _scopes(_entries(tensors, holders, job_wide))


@functools.lru_cache(maxsize=8)
def _plan(entries: tuple[_Entry, ...]) -> dict[tuple[str, tuple[int, ...]], int]:
    """(name, holders) -> writer, for a state described by ``entries`` (cached: a state keeps its shape)."""
    return {(piece.name, piece.holders): writer for piece, writer in assign_writers(_scopes(entries)).items()}


def _turns(holders: tuple[int, ...]) -> dict[int, int]:
    """Each holder's place in the tie order of a piece: the holders rotated by a digest of them."""
    turn = xxhash.xxh3_64_intdigest(",".join(map(str, holders)).encode()) % len(holders)
    return {member: (i - turn) % len(holders) for i, member in enumerate(holders)}


def assign_writers(scopes: Mapping[tuple[int, ...], Sequence[Piece]]) -> dict[Piece, int]:
    """The writer of every replicated piece of ``scopes``; a pure function of them, so every rank that
    describes the same scopes gets the same answer."""
    writers: dict[Piece, int] = {}
    planned: list[tuple[frozenset[int], dict[int, int]]] = []
    for scope, pieces in sorted(scopes.items(), key=lambda item: (-len(item[0]), item[0])):
        members = frozenset(scope)
        load: dict[int, int] = defaultdict(int)
        for earlier, loads in planned:
            if earlier >= members:
                for member, size in loads.items():
                    load[member] += size
        own: dict[int, int] = defaultdict(int)
        for piece in pieces:
            if len(piece.holders) == 1:
                own[piece.holders[0]] += piece.nbytes
                load[piece.holders[0]] += piece.nbytes
        replicated = sorted((p for p in pieces if len(p.holders) > 1), key=lambda p: (-p.nbytes, p.name, p.holders))
        for piece in replicated:
            turns = _turns(piece.holders)
            chosen = min(piece.holders, key=lambda member: (load[member], turns[member]))
            writers[piece] = chosen
            load[chosen] += piece.nbytes
            own[chosen] += piece.nbytes
        _unload_busiest(replicated, writers, load, own, members)
        planned.append((members, dict(own)))
    return writers


def _unload_busiest(pieces: list[Piece], writers: dict[Piece, int], load: dict[int, int],
                    own: dict[int, int], members: frozenset[int]) -> None:
    """Move a piece off the busiest rank (to its least busy other holder) while that leaves both below what
    the busiest rank had; deterministic, at most ``8 x ranks`` moves (each looks at the busiest rank's
    pieces only)."""
    by_writer: dict[int, list[Piece]] = defaultdict(list)
    for piece in pieces:
        by_writer[writers[piece]].append(piece)
    ranks = sorted(members)
    for _ in range(8 * len(ranks)):
        busiest = max(ranks, key=lambda member: (load[member], -member))
        best: tuple[int, int, Piece, int] | None = None
        for piece in by_writer[busiest]:
            target = min((m for m in piece.holders if m != busiest), key=lambda m: (load[m], m))
            after = load[target] + piece.nbytes
            if after < load[busiest]:
                key = (max(after, load[busiest] - piece.nbytes), -piece.nbytes, piece, target)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is None:
            return
        _, _, piece, target = best
        writers[piece] = target
        by_writer[busiest].remove(piece)
        by_writer[target].append(piece)
        for member, change in ((busiest, -piece.nbytes), (target, piece.nbytes)):
            load[member] += change
            own[member] += change


def plan_writers(tensors: Mapping[str, torch.Tensor], holders: Mapping[str, tuple[int, ...]], *,
                 rank: int, job_wide: bool = True) -> WritePlan:
    """One writer per replicated piece, balanced by bytes job-wide (``job_wide=False``: within each group
    of holders); see the module docstring."""
    by_name = _plan(_entries(tensors, holders, job_wide))
    writers = {name: by_name[(name, group)] for name, group in holders.items()}
    return WritePlan(rank=rank, holders=dict(holders), writers=writers)


def rank_bytes(scopes: Scopes, writers: Mapping[Piece, int]) -> dict[int, int]:
    """The bytes each rank writes of ``scopes`` under ``writers`` (a unique piece by its one holder)."""
    written: dict[int, int] = defaultdict(int)
    for pieces in scopes.values():
        for piece in pieces:
            written[writers.get(piece, piece.holders[0])] += piece.nbytes
    return dict(written)


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

