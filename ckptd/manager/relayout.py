"""Restoring a step into another layout: TP, PP stage split, DP size or FSDP sharding changed.

Used by :mod:`ckptd.manager.restoring` for a step whose manifest records a layout
(:mod:`ckptd.format.mesh_layout`) when the world size or the mesh differs from the live job's. Every saved
rank's index is read (through every tier that holds it, so a piece another node wrote is found on the
object or peer tier), and the live state decides what is loaded:

- the skeleton is the one of the saved rank with this rank's number (saved rank 0 when there are fewer),
  completed with the entries that only other saved ranks hold (a pipeline stage's layers) and pruned of
  tensor entries the live state has no place for (the layers of another stage);
- a tensor that was a DTensor shard, or whose live target is a DTensor, is loaded with
  ``torch.distributed.checkpoint.load`` and ckptd's reader: DCP's planner reads the stored regions the
  live shard needs, whoever wrote them;
- any other tensor is read whole from the saved rank that held it (from its writer, for a replica);
- a live tensor of another global shape or dtype raises :class:`~ckptd.errors.ResumeMismatchError`
  naming it.

Call on every rank, from the training thread, with the same step: ``dcp.load`` is called once on every
rank and issues collectives on the default process group.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ckptd.state.live_reader import TensorReader, live_reader
from ckptd.errors import CkptdError, ResumeMismatchError
from ckptd.format.records import DTYPE_NAMES, Manifest
from ckptd.format.values import manager_skeleton, parse_values
from ckptd.state.tree import flatten, skeleton_tensor_names
from ckptd.stepio.step_reader import StepReader
from ckptd.tiers.base import StorageTier

_TENSOR_KINDS = ("tensor", "ndarray", "pickle")


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


class _Merged:
    """The skeleton this rank loads and, for each tensor name in it, the saved rank whose skeleton holds it."""

    def __init__(self, skeletons: list[Any], own: int) -> None:
        self.owner: dict[str, int] = {}
        order = [own] + [r for r in range(len(skeletons)) if r != own]
        self._claim(skeletons[own], own)
        self.skeleton = skeletons[own]
        for rank in order[1:]:
            self.skeleton = self._merge(self.skeleton, skeletons[rank], rank)

    def _claim(self, node: Any, rank: int) -> None:
        if isinstance(node, dict):
            for kind in _TENSOR_KINDS:
                if kind in node and isinstance(node[kind], str):
                    self.owner.setdefault(node[kind], rank)
                    return
            for child in node.values():
                self._claim(child, rank)
        elif isinstance(node, list):
            for child in node:
                self._claim(child, rank)

    def _merge(self, ours: Any, theirs: Any, rank: int) -> Any:
        if not (isinstance(ours, dict) and isinstance(theirs, dict)):
            return ours
        if "stateful" in ours and "stateful" in theirs:
            return {**ours, "stateful": self._merge(ours["stateful"], theirs["stateful"], rank)}
        if "dict" not in ours or "dict" not in theirs:
            return ours
        items = [list(item) for item in ours["dict"]]
        where = {item[0]: i for i, item in enumerate(items)}
        for key, child in theirs["dict"]:
            if key in where:
                items[where[key]][1] = self._merge(items[where[key]][1], child, rank)
            else:
                self._claim(child, rank)
                items.append([key, child])
        return {**ours, "dict": items}


def _tensors_only(node: Any) -> bool:
    """Whether a skeleton node holds tensors and containers of them only (no plain value)."""
    if not isinstance(node, dict) or not node:
        return False
    kind = next(iter(node))
    if kind in _TENSOR_KINDS:
        return True
    if kind == "stateful":
        return _tensors_only(node["stateful"])
    if kind == "dict":
        return all(_tensors_only(child) for _, child in node["dict"])
    if kind in ("list", "tuple"):
        return all(_tensors_only(child) for child in node[kind])
    return False


def _pruned(node: Any, live: Any) -> Any:
    """``node`` without the tensor entries that the live mapping ``live`` has no key for (recursively)."""
    if not isinstance(node, dict):
        return node
    if "stateful" in node:
        template = live.state_dict() if callable(getattr(live, "state_dict", None)) else None
        return {**node, "stateful": _pruned(node["stateful"], template)}
    if "dict" not in node or not isinstance(live, Mapping):
        return node
    kept = [[key, _pruned(child, live.get(key))] for key, child in node["dict"]
            if key in live or not _tensors_only(child)]
    return {**node, "dict": kept}


def relayout_source(tiers: list[StorageTier], step: int, live: MutableMapping[str, Any], *, rank: int,
                    allow_pickle: bool) -> tuple[Any, TensorReader, list[StepReader]]:
    """The skeleton this rank restores, a tensor reader for it, and the step readers it reads from (to
    settle); loads the tensors that need resharding through DCP first (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptd.dcp.reader import CkptdStorageReader

    opened = CkptdStorageReader(list(tiers), step, allow_pickle=allow_pickle)
    opened.read_metadata()
    manifest: Manifest = opened.manifest  # type: ignore[assignment]
    tier = tiers[0].label if tiers else None
    readers = [opened.step_reader(r) for r in range(manifest.world_size)]
    values = [parse_values(reader.index.values) for reader in readers]
    merged = _Merged([manager_skeleton(v, step=step) for v in values], rank if rank < len(readers) else 0)
    skeleton = _pruned(merged.skeleton, live)
    live_tensors = flatten(_pruned_live(skeleton, live), allow_pickle=True).tensors

    def holder(name: str) -> StepReader:
        saved_rank = merged.owner[name]
        writer = manifest.entry(saved_rank).replicas.get(name, saved_rank)
        return readers[writer]

    def mismatch(name: str, saved: str, shape: tuple[int, ...], target: torch.Tensor) -> ResumeMismatchError:
        return ResumeMismatchError(
            f"tensor {name!r} was saved as {saved} {list(shape)} but the live state holds "
            f"{DTYPE_NAMES.get(target.dtype)} {list(target.shape)} there: the target cannot hold it", step=step,
            tier=tier,
            hint="build the model with the saved sizes and dtypes (`ckptd inspect` lists them)")

    targets: dict[str, torch.Tensor] = {}
    via_dcp: dict[str, str] = {}
    refused: CkptdError | None = None  # raised after dcp.load: every rank must take part in it
    loaded_names = set(skeleton_tensor_names(skeleton))
    for name, saved_rank in merged.owner.items():
        shard = values[saved_rank].shards.get(name)
        target = live_tensors.get(name)
        if name not in loaded_names or (shard is None and not _is_dtensor(target)):
            continue
        try:
            record = holder(name).record(name)
        except CkptdError as error:
            refused = refused or error
            continue
        fqn, shape = (shard[0], shard[1].global_shape) if shard is not None else (name, record.shape)
        dtype = record.dtype
        if target is None:
            target = torch.empty(shape, dtype=_torch_dtype(dtype))
        elif tuple(target.shape) != tuple(shape) or DTYPE_NAMES.get(target.dtype) != dtype:
            refused = refused or mismatch(name, dtype, tuple(shape), target)
            continue
        targets[fqn], via_dcp[name] = target, fqn
    dcp.load(targets, storage_reader=CkptdStorageReader(list(tiers), step, allow_pickle=allow_pickle),
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    if refused is not None:
        raise refused

    def read_whole(name: str, out: torch.Tensor | None) -> torch.Tensor:
        reader = holder(name)
        record = reader.record(name)
        if out is not None and (tuple(out.shape) != record.shape or DTYPE_NAMES.get(out.dtype) != record.dtype):
            raise mismatch(name, record.dtype, record.shape, out)
        return reader.read_tensor(name, out, defer=True)

    whole = live_reader(read_whole)

    def read(name: str, out: torch.Tensor | None) -> torch.Tensor:
        if name not in via_dcp:
            return whole(name, out)
        loaded = targets[via_dcp[name]]
        if out is None or out is loaded:
            return loaded
        with torch.no_grad():
            out.copy_(loaded)
        return out

    return skeleton, read, readers


def _pruned_live(skeleton: Any, live: MutableMapping[str, Any]) -> dict[str, Any]:
    """The live state's top-level entries that the skeleton loads (a partial restore flattens no more)."""
    keys = {item[0] for item in skeleton.get("dict", [])}
    return {key: value for key, value in live.items() if key in keys}


def _torch_dtype(name: str) -> torch.dtype:
    from ckptd.format.records import DTYPES

    return DTYPES[name]
