"""What a rank index stores besides its tensors: the JSON ``values`` shared by every writer.

One layout serves :class:`~ckptd.manager.manager.CheckpointManager` and the DCP storage plugins, so a
step written by either is read by both. ``values`` is the root node of the manager's state skeleton
(:mod:`ckptd.state.tree`: ``{"dict": [...], "ordered": ...}``, so code that reads it as a skeleton keeps
working) with these keys added after the skeleton's own:

- ``layout``: ``"ckptd-state/1"``; ``source``: ``"manager"`` or ``"dcp"`` (a DCP-written step has an
  empty skeleton: its state is described by the tensor names and ``objects``).
- ``shards``: ``{name: [fqn, global_shape, offsets]}`` for a tensor stored under ``name`` that is a
  piece of a larger tensor (a DTensor shard or a DCP write item). A tensor without an entry is whole:
  its fqn is its name and its offsets are zero.
- ``objects``: ``{fqn: skeleton}`` for non-tensor values DCP asked to save, kept as JSON (never pickled).
- ``pickled``: names of uint8 tensors holding DCP's pickled bytes for values JSON cannot hold; written
  and read only when the caller opted in with ``allow_pickle=True``.
- ``buffers``: names of uint8 tensors holding the bytes of an ``io.BytesIO`` value DCP asked to save
  (no pickle; read back as an ``io.BytesIO`` with the same content).
- ``quantized``: ``{name: parameters}`` for a quantized tensor stored as its integer representation
  (dtype, scheme, scale(s), zero point(s), axis; see :mod:`ckptd.dcp.quantized`).

``buffers`` and ``quantized`` name tensors that a reader which does not know these keys would hand out
as plain uint8/integer tensors: a step using them has a manifest of format version
:data:`VALUE_KEYS_SINCE` or later (older readers refuse it by its version), and :func:`parse_values`
refuses them in a step whose manifest is older.

DCP's ``Metadata`` is derived from these records by :mod:`ckptd.dcp.metadata`; nothing is pickled.
An index whose values lack ``layout`` (written before it existed) is read as a bare skeleton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import FormatError, ResumeMismatchError
from ckptd.format.records import LAYOUT_SINCE

STATE_LAYOUT = "ckptd-state/1"
#: Manifest format version from which rank indexes may hold ``buffers`` and ``quantized``.
VALUE_KEYS_SINCE = LAYOUT_SINCE
_EXTRA_KEYS = frozenset({"layout", "source", "shards", "objects", "pickled", "buffers", "quantized"})


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
    buffers: frozenset[str] = frozenset()
    quantized: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if self.skeleton is not None and not (isinstance(self.skeleton, dict) and "dict" in self.skeleton):
            raise FormatError("the state skeleton must be a mapping node")
        body: dict[str, Any] = dict(self.skeleton) if self.skeleton is not None else {"dict": [], "ordered": False}
        body.update({
            "layout": STATE_LAYOUT,
            "source": "dcp" if self.skeleton is None else "manager",
            "shards": {name: [fqn, list(p.global_shape), list(p.offsets)]
                       for name, (fqn, p) in self.shards.items()},
            "objects": self.objects,
            "pickled": sorted(self.pickled),
        })
        if self.buffers:
            body["buffers"] = sorted(self.buffers)
        if self.quantized:
            body["quantized"] = self.quantized
        return body

    def placement(self, name: str, shape: tuple[int, ...]) -> tuple[str, ShardPlacement]:
        """The fqn and placement of a stored tensor (whole tensors map to themselves)."""
        found = self.shards.get(name)
        if found is not None:
            return found
        return name, ShardPlacement(shape, (0,) * len(shape))


def parse_values(values: Any, *, path: str | None = None, step: int | None = None,
                 manifest_version: int | None = None) -> SavedValues:
    """Parse the ``values`` of a rank index, validating what readers rely on. With ``manifest_version``
    (the step's manifest format), keys that version cannot have are refused."""
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
    buffers = values.get("buffers") or []
    quantized = values.get("quantized") or {}
    if not isinstance(objects, dict) or not isinstance(pickled, list) or not isinstance(buffers, list) \
            or not isinstance(quantized, dict):
        fail("'objects', 'pickled', 'buffers' or 'quantized' has the wrong type")
    if manifest_version is not None and manifest_version < VALUE_KEYS_SINCE and (buffers or quantized):
        fail(f"'buffers' or 'quantized' in a step of manifest format {manifest_version}, which cannot have "
             f"them (they came with format {VALUE_KEYS_SINCE}); the step was altered or written wrongly")
    skeleton = None
    if values.get("source") == "manager":
        skeleton = {key: value for key, value in values.items() if key not in _EXTRA_KEYS}
    return SavedValues(skeleton=skeleton, shards=shards, objects=objects, pickled=frozenset(str(n) for n in pickled),
                       buffers=frozenset(str(n) for n in buffers), quantized=quantized)


def manager_skeleton(values: SavedValues, *, step: int) -> Any:
    """The state skeleton of a step a CheckpointManager wrote; ResumeMismatchError for a DCP-written one."""
    if values.skeleton is None:
        raise ResumeMismatchError("this step was written with dcp.save, not by a CheckpointManager", step=step,
                                  hint="load it with torch.distributed.checkpoint.load and "
                                  "ckptd.dcp.CkptdStorageReader")
    return values.skeleton
