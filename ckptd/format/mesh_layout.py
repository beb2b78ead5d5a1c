"""How a job was laid out over its ranks: the device mesh, each rank's coordinates, and who holds what.

:class:`Layout` is what a user gives a :class:`~ckptd.manager.manager.CheckpointManager` (or what ckptd
derives from the DTensors of the state): the mesh dimensions by name and size (``pp``, ``dp``, ``tp``,
``ep``, ...), the ZeRO/FSDP stage when known, and which mesh dimensions hold plain (non-DTensor) state
identically (data parallelism: every ``dp`` replica holds the same weights). Ranks map to coordinates
in row-major order of the mesh, as ``torch.distributed.device_mesh.init_device_mesh`` lays them out.

:class:`SavedLayout` is the manifest's record of it (format version 4): the mesh, the coordinates of
every rank, the stage, and every piece held by more than one rank with the rank that wrote it and the
ranks that hold it. A piece held by one rank is in that rank's index and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import ConfigError, FormatError

#: Every plain tensor of the state (the value of a ``replicated`` mapping entry that applies to all keys).
ALL_KEYS = "*"


@dataclass(frozen=True)
class Layout:
    """A job's parallel layout, as the user states it.

    ``mesh``: dimension name -> size, outermost first (``{"pp": 2, "dp": 4, "tp": 8}``); their product is
    the world size. ``zero_stage``: 0-3 (FSDP full sharding is 3), None when unknown; recorded only.
    ``replicated``: the mesh dimensions across which plain tensors are identical, for every key of the
    state (a sequence of dimension names) or per top-level key (``{"model": ("dp",)}``; ``"*"`` for every
    key). DTensors need no entry: their ``Replicate`` placements say it. A key marked replicated must hold
    the same values on every holder: one holder writes it and every holder restores that copy.

    Example: ``Layout(mesh={"dp": 2, "tp": 2}, replicated={"model": ("dp",)}, zero_stage=1)``.
    """

    mesh: Mapping[str, int]
    zero_stage: int | None = None
    replicated: Mapping[str, Sequence[str]] | Sequence[str] = ()

    def __post_init__(self) -> None:
        mesh = dict(self.mesh)
        if not mesh or any(not isinstance(n, str) or not n or not isinstance(s, int) or isinstance(s, bool)
                           or s < 1 for n, s in mesh.items()):
            raise ConfigError(f"Layout mesh {self.mesh!r} must map dimension names to sizes >= 1",
                              hint='pass e.g. Layout(mesh={"dp": 2, "tp": 2})')
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"Layout zero_stage {self.zero_stage!r} is not 0, 1, 2, 3 or None")
        rules = self.replication_rules
        for key, dims in rules.items():
            unknown = [d for d in dims if d not in mesh]
            if unknown:
                raise ConfigError(f"Layout replicated dimension(s) {unknown} for key {key!r} are not in the mesh "
                                  f"{list(mesh)}", hint="name mesh dimensions, e.g. replicated=('dp',)")
        object.__setattr__(self, "mesh", mesh)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.mesh)

    @property
    def replication_rules(self) -> dict[str, tuple[str, ...]]:
        """Top-level key (``"*"``: every key) -> the dimensions across which its plain tensors are identical."""
        if isinstance(self.replicated, Mapping):
            return {str(key): _names(dims) for key, dims in self.replicated.items()}
        dims = _names(self.replicated)
        return {ALL_KEYS: dims} if dims else {}

    def replicated_dims(self, key: str) -> tuple[str, ...]:
        """The dimensions across which the plain tensors under top-level ``key`` are identical."""
        rules = self.replication_rules
        return rules.get(key, rules.get(ALL_KEYS, ()))

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of ``rank`` (row-major, outermost dimension first)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh {self.mesh} ({self.world_size} ranks)")
        coords = []
        for size in reversed(list(self.mesh.values())):
            rank, coord = divmod(rank, size)
            coords.append(coord)
        return tuple(reversed(coords))

    def rank_at(self, coordinates: Sequence[int]) -> int:
        rank = 0
        for coord, size in zip(coordinates, self.mesh.values()):
            rank = rank * size + coord
        return rank

    def holders(self, rank: int, dims: Sequence[str]) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinates on every dimension but ``dims``, ascending."""
        mine = self.coordinates(rank)
        found = [mine]
        for axis, name in enumerate(self.mesh):
            if name in dims:
                found = [c[:axis] + (i,) + c[axis + 1:] for c in found for i in range(self.mesh[name])]
        return tuple(sorted(self.rank_at(c) for c in found))


def _names(dims: Any) -> tuple[str, ...]:
    if isinstance(dims, str):
        return (dims,)
    return tuple(str(d) for d in dims)


@dataclass(frozen=True)
class ReplicatedPiece:
    """A stored piece held identically by several ranks: its name, the rank that wrote it, its holders."""

    name: str
    writer: int
    holders: tuple[int, ...]

    def to_json(self) -> list[Any]:
        return [self.name, self.writer, list(self.holders)]


@dataclass(frozen=True)
class SavedLayout:
    """The manifest's layout record (see the module docstring)."""

    mesh: dict[str, int]
    coordinates: tuple[tuple[int, ...], ...]
    zero_stage: int | None = None
    #: ``"given"`` (a Layout passed by the user) or ``"dtensor"`` (derived from the state's device meshes).
    source: str = "given"
    replicated: tuple[ReplicatedPiece, ...] = field(default_factory=tuple)
    #: DTensor name -> its placements on the mesh, as rank 0 saved them (``"R,S0"``: Replicate, Shard(0)).
    placements: dict[str, str] = field(default_factory=dict)

    def writer_of(self, rank: int, name: str) -> int | None:
        """The rank that wrote the piece ``rank`` holds under ``name`` when another rank wrote it, else None."""
        for piece in self.replicated:
            if piece.name == name and rank in piece.holders:
                return piece.writer
        return None

    def to_json(self) -> dict[str, Any]:
        return {"mesh": [[name, size] for name, size in self.mesh.items()],
                "coordinates": [list(c) for c in self.coordinates], "zero_stage": self.zero_stage,
                "source": self.source, "replicated": [piece.to_json() for piece in self.replicated],
                "placements": dict(self.placements)}

    @classmethod
    def from_json(cls, body: Any, *, world_size: int, path: str, step: int | None) -> SavedLayout:
        def fail(why: str) -> Any:
            raise FormatError(f"malformed layout in the manifest: {why}", path=path, step=step,
                              hint="use an older step or another tier")

        if not isinstance(body, dict):
            fail("'layout' is not an object")
        mesh_json = body.get("mesh")
        if not isinstance(mesh_json, list) or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and _count(item[1])
                for item in mesh_json):
            fail("'mesh' is not a list of [name, size] pairs")
        mesh = {name: size for name, size in mesh_json}
        coords = body.get("coordinates")
        if not isinstance(coords, list) or len(coords) != world_size or not all(
                isinstance(c, list) and all(_count(v, 0) for v in c) for c in coords):
            fail(f"'coordinates' is not one list of non-negative integers per rank ({world_size})")
        stage = body.get("zero_stage")
        if stage not in (None, 0, 1, 2, 3):
            fail(f"zero_stage {stage!r} is not 0-3 or null")
        source = body.get("source")
        if not isinstance(source, str):
            fail("'source' is not a string")
        pieces = []
        for item in body.get("replicated") or []:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and _count(item[1], 0) and item[1] < world_size and isinstance(item[2], list)
                    and all(_count(r, 0) and r < world_size for r in item[2]) and item[1] in item[2]):
                fail("a replicated piece is not [name, writer, [holders]] with the writer among the holders")
            pieces.append(ReplicatedPiece(item[0], item[1], tuple(item[2])))
        placements = body.get("placements") or {}
        if not isinstance(placements, dict) or not all(isinstance(v, str) for v in placements.values()):
            fail("'placements' is not an object of strings")
        return cls(mesh=mesh, coordinates=tuple(tuple(c) for c in coords), zero_stage=stage, source=source,
                   replicated=tuple(pieces), placements=placements)


def _count(value: Any, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
