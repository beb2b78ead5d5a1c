"""What a rank index stores besides its tensors: the JSON ``values`` shared by every writer.

One layout serves :class:`~ckptd.manager.manager.CheckpointManager` and the DCP storage plugins, so a
step written by either is read by both:

``{"layout": "ckptd-state/1", "skeleton": <state skeleton or null>, "shards": {name: [fqn,
global_shape, offsets]}, "objects": {fqn: <skeleton of a non-tensor value>}, "pickled": [names]}``

- ``skeleton``: the manager's state skeleton (:mod:`ckptd.state.tree`); null for DCP-written steps.
- ``shards``: for a tensor stored under ``name`` that is a piece of a larger tensor (a DTensor shard or
  a DCP write item), the fully qualified name of the whole tensor, its global shape and the offsets of
  the piece. A tensor without an entry is whole: its fqn is its name and its offsets are zero.
- ``objects``: non-tensor values DCP asked to save, kept as JSON skeletons (never pickled).
- ``pickled``: names of uint8 tensors holding DCP's pickled bytes for values JSON cannot hold; written
  and read only when the caller opted in with ``allow_pickle=True``.

DCP's ``Metadata`` is derived from these records by :mod:`ckptd.dcp.metadata`; nothing is pickled.
An index whose values are not in this layout (written before it existed) is read as a bare skeleton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import FormatError

STATE_LAYOUT = "ckptd-state/1"


@dataclass(frozen=True)
class ShardPlacement:
    """Where a stored tensor sits inside the global tensor it is a piece of."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class SavedValues:
    """The parsed ``values`` of a rank index."""

    skeleton: Any = None
    shards: dict[str, tuple[str, ShardPlacement]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    pickled: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": STATE_LAYOUT,
            "skeleton": self.skeleton,
            "shards": {name: [fqn, list(p.global_shape), list(p.offsets)]
                       for name, (fqn, p) in self.shards.items()},
            "objects": self.objects,
            "pickled": sorted(self.pickled),
        }

    def placement(self, name: str, shape: tuple[int, ...]) -> tuple[str, ShardPlacement]:
        """The fqn and placement of a stored tensor (whole tensors map to themselves)."""
        found = self.shards.get(name)
        if found is not None:
            return found
        return name, ShardPlacement(shape, (0,) * len(shape))


def parse_values(values: Any, *, path: str | None = None, step: int | None = None) -> SavedValues:
    """Parse the ``values`` of a rank index, validating what readers rely on."""
    if not isinstance(values, dict) or values.get("layout") != STATE_LAYOUT:
        return SavedValues(skeleton=values)

    def fail(why: str) -> Any:
        raise FormatError(f"malformed state values in a rank index: {why}", path=path, step=step)

    shards: dict[str, tuple[str, ShardPlacement]] = {}
    raw_shards = values.get("shards") or {}
    if not isinstance(raw_shards, dict):
        fail("'shards' is not an object")
    for name, item in raw_shards.items():
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and all(isinstance(v, list) for v in item[1:]) and len(item[1]) == len(item[2])
                and all(isinstance(n, int) and n >= 0 for n in item[1] + item[2])):
            fail(f"shard record of {name!r} is not [fqn, global_shape, offsets]")
        shards[name] = (item[0], ShardPlacement(tuple(item[1]), tuple(item[2])))
    objects = values.get("objects") or {}
    pickled = values.get("pickled") or []
    if not isinstance(objects, dict) or not isinstance(pickled, list):
        fail("'objects' or 'pickled' has the wrong type")
    return SavedValues(skeleton=values.get("skeleton"), shards=shards, objects=objects,
                       pickled=frozenset(str(n) for n in pickled))
