"""The layout of a save: where this rank sits in the job's mesh, which pieces it writes, the manifest record.

:class:`LayoutRecorder` belongs to a :class:`~ckptd.manager.saving.Saver`. On the training thread,
:meth:`LayoutRecorder.holdings` looks at a flattened state: with a :class:`~ckptd.format.mesh_layout.Layout`
given by the user, or DTensors whose device mesh says it, the save gets :class:`Holdings` (its mesh, this
rank's coordinates and the :class:`~ckptd.state.replicas.WritePlan`); without either it gets None and the
step is written as before (format 3, every rank writes its whole state). On the writer thread,
:meth:`Holdings.entry` adds the rank's coordinates and replicas to its manifest entry, and on rank 0
:meth:`Holdings.manifest` turns the entries into the manifest's :class:`~ckptd.format.mesh_layout.SavedLayout`
(format 4), refusing a step in which a rank refers to a piece its writer did not write: no replica is
then lost to ranks that disagree on the plan.

``write_replicas``: ``"once"`` writes each replicated piece by one of all its holders; ``"once-per-directory"``
by one of its holders in each local directory (each directory then holds a whole copy of its ranks' state,
so a node restores without reading another node's files); ``"every-rank"`` keeps the old behaviour (every
rank writes its whole state) and still records the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ckptd.errors import CommitError, ConfigError
from ckptd.format.mesh_layout import Layout, ReplicatedPiece, SavedLayout
from ckptd.format.records import DTYPE_NAMES, LAYOUT_SINCE, Manifest, RankEntry
from ckptd.format.values import ShardPlacement
from ckptd.state.replicas import WritePlan, holders_of, local_part, mesh_of_state, placement_codes, plan_writers
from ckptd.state.staging import local_view

WRITE_REPLICAS = ("once", "once-per-directory", "every-rank")


@dataclass(frozen=True)
class Holdings:
    """One save's layout as this rank sees it."""

    mesh: dict[str, int]
    coordinates: tuple[int, ...]
    source: str
    zero_stage: int | None
    plan: WritePlan
    #: DTensor name -> placements (see :func:`~ckptd.state.replicas.placement_codes`).
    dtensor_placements: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Replicated piece -> its dtype and local shape as this rank holds it (checked against the writer's).
    signatures: dict[str, str] = dataclasses.field(default_factory=dict)

    @staticmethod
    def placements(tensors: Mapping[str, torch.Tensor]) -> dict[str, ShardPlacement]:
        """The place of every DTensor's local shard in its global tensor, written or not (metadata only)."""
        found = {}
        for name, tensor in tensors.items():
            _, placement = local_view(tensor.detach())
            if placement is not None:
                found[name] = placement
        return found

    def entry(self, entry: RankEntry) -> RankEntry:
        """Writer thread: this rank's manifest entry with its coordinates and replicated pieces."""
        return dataclasses.replace(entry, coordinates=self.coordinates, replicas=self.plan.replicas,
                                   shared=self.plan.shared, signatures=dict(self.signatures))

    def manifest(self, manifest: Manifest) -> Manifest:
        """Rank 0, writer thread: the manifest with the layout record; CommitError when a rank refers to a
        piece that its writer did not write (the ranks disagreed on the plan), or that the writer holds with
        another dtype or shape (the holders' tensors differ: one copy would not restore both)."""
        by_rank = {entry.rank: entry for entry in manifest.ranks}
        hint = ("replicated state must have the same names, dtypes and shapes on every holder; save with "
                "write_replicas='every-rank' or fix the layout's replicated dimensions")
        for entry in manifest.ranks:
            for name, writer in sorted(entry.replicas.items()):
                holders = by_rank[writer].shared.get(name) if writer in by_rank else None
                if holders is None or entry.rank not in holders:
                    raise CommitError(
                        f"rank {entry.rank} left tensor {name!r} to rank {writer}, which did not write it for "
                        f"rank {entry.rank}: the ranks disagree on who holds it", step=manifest.step, hint=hint)
                mine, theirs = entry.signatures.get(name), by_rank[writer].signatures.get(name)
                if mine != theirs:
                    raise CommitError(
                        f"tensor {name!r} is held as {mine} by rank {entry.rank} but as {theirs} by rank {writer}, "
                        f"which writes it for both: the holders of a replicated piece hold different tensors",
                        step=manifest.step, hint=hint)
        manifest = dataclasses.replace(manifest, ranks=tuple(dataclasses.replace(entry, signatures={})
                                                             for entry in manifest.ranks))
        pieces = tuple(ReplicatedPiece(name, entry.rank, holders) for entry in manifest.ranks
                       for name, holders in sorted(entry.shared.items()))
        layout = SavedLayout(mesh=dict(self.mesh), coordinates=tuple(entry.coordinates or () for entry in
                                                                     manifest.ranks),
                             zero_stage=self.zero_stage, source=self.source, replicated=pieces,
                             placements=dict(self.dtensor_placements))
        return dataclasses.replace(manifest, layout=layout, format_version=LAYOUT_SINCE)


class LayoutRecorder:
    """Decides, per save, this rank's :class:`Holdings` (see the module docstring). Training thread."""

    def __init__(self, rank: int, layout: Layout | None = None, *, world_size: int | None = None,
                 write_replicas: str = "once", directory_ranks: tuple[int, ...] | None = None) -> None:
        if write_replicas not in WRITE_REPLICAS:
            raise ConfigError(f"write_replicas={write_replicas!r} is not one of {', '.join(WRITE_REPLICAS)}",
                              hint="'once' writes a replicated piece by one holder, 'once-per-directory' by one "
                                   "in each local directory, 'every-rank' by each")
        if layout is not None and world_size is not None and layout.world_size != world_size:
            raise ConfigError(f"the layout's mesh {layout.mesh} has {layout.world_size} ranks but the job has "
                              f"{world_size}", hint="give a mesh whose sizes multiply to the world size")
        self.rank, self.layout, self.write_replicas = rank, layout, write_replicas
        #: The ranks sharing this rank's local directory ("once-per-directory"; None: the whole job).
        self.directory_ranks = directory_ranks

    def holdings(self, tensors: Mapping[str, torch.Tensor]) -> Holdings | None:
        if self.layout is not None:
            mesh, coordinates, source = dict(self.layout.mesh), self.layout.coordinates(self.rank), "given"
        else:
            found = mesh_of_state(tensors)
            if found is None:
                return None
            (mesh, coordinates), source = found, "dtensor"
        holders = {} if self.write_replicas == "every-rank" else holders_of(tensors, rank=self.rank, layout=self.layout)
        if self.write_replicas == "once-per-directory" and self.directory_ranks is not None:
            here = set(self.directory_ranks)
            holders = {name: kept for name, group in holders.items()
                       if len(kept := tuple(r for r in group if r in here)) > 1}
        codes = {name: code for name, code in ((n, placement_codes(t)) for n, t in tensors.items())
                 if code is not None}
        return Holdings(mesh=mesh, coordinates=coordinates, source=source,
                        zero_stage=None if self.layout is None else self.layout.zero_stage,
                        plan=plan_writers(tensors, holders, rank=self.rank,
                                          job_wide=self.write_replicas == "once"), dtensor_placements=codes,
                        signatures={name: _signature(tensors[name]) for name in holders})


def _signature(tensor: torch.Tensor) -> str:
    """A replicated piece's dtype and local shape, as this rank holds it: ``"float32[4, 6]"``."""
    local = local_part(tensor)
    return f"{DTYPE_NAMES.get(local.dtype, str(local.dtype))}{list(local.shape)}"
