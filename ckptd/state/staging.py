"""Staging: the only blocking part of a save, a copy of the state into reusable host buffers.

A :class:`Stager` owns one host buffer per tensor name. The first save allocates them (pinned when
CUDA is present and ``CKPTD_PIN_STAGING`` is on, so device-to-host copies run at full bandwidth); later
saves copy into the same memory, which costs a fraction of a fresh allocation. A buffer is
reallocated only when the shape or dtype under a name changes, and names that disappear are dropped.
Buffers start on a page boundary, so the writer sends them to disk with direct I/O without a copy.

The staged copy is the **memory tier**: it stays valid until the next :meth:`Stager.stage`, so a
process can restore from it without reading disk. The background writer reads the buffers; the
:class:`~ckptd.manager.saving.Saver` never stages while a write still reads them (back-pressure), so
host memory stays bounded by one copy of the state, and by ``CKPTD_STAGING_BUDGET_BYTES`` when set.

Thread: :meth:`Stager.stage` runs on the training thread; :class:`StagedState` is read-only afterwards
and may be read from any thread until the next ``stage``. DTensors are staged as their local shard,
with the shard's place in the global tensor (see :class:`ShardPlacement`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.config import settings
from ckptd.format.values import ShardPlacement
from ckptd.errors import ConfigError
from ckptd.tiers.direct_io import aligned_empty


def local_view(tensor: torch.Tensor) -> tuple[torch.Tensor, ShardPlacement | None]:
    """The local data of a tensor and, for a DTensor, the placement of that shard in the global tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return tensor, None
    if not isinstance(tensor, DTensor):
        return tensor, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    return local, ShardPlacement(tuple(tensor.shape), tuple(int(o) for o in offsets))


@dataclass(frozen=True)
class StagedState:
    """One staged save: host copies of every tensor (by name) and the placement of sharded ones."""

    tensors: dict[str, torch.Tensor]
    placements: dict[str, ShardPlacement] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Stager:
    """Copies tensors into host buffers it allocates once and reuses for every later save.

    ``budget_bytes`` (0: none) bounds the host memory the buffers may take; a state that does not fit
    is refused with a :class:`~ckptd.errors.ConfigError` before anything is copied.
    """

    def __init__(self, *, budget_bytes: int | None = None, pin: bool | None = None) -> None:
        self.budget_bytes = settings().staging_budget_bytes if budget_bytes is None else budget_bytes
        want_pin = settings().pin_staging if pin is None else pin
        self.pin = bool(want_pin and torch.cuda.is_available())
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    @property
    def held_bytes(self) -> int:
        """Host memory the buffers take now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StagedState:
        """Copy every tensor into its buffer and return the staged state (training thread).

        On return the caller may modify the source tensors. The previous :class:`StagedState` is
        overwritten: the caller must make sure no writer still reads it.
        """
        locals_: dict[str, tuple[torch.Tensor, ShardPlacement | None]] = {
            name: local_view(tensor.detach()) for name, tensor in tensors.items()}
        needed = sum(t.numel() * t.element_size() for t, _ in locals_.values())
        if self.budget_bytes and needed > self.budget_bytes:
            raise ConfigError(
                f"the state needs {needed} bytes of host memory to stage but the staging budget is "
                f"{self.budget_bytes}", hint="raise CKPTD_STAGING_BUDGET_BYTES or save less state")
        for name in set(self._buffers) - set(locals_):
            del self._buffers[name]
        staged: dict[str, torch.Tensor] = {}
        placements: dict[str, ShardPlacement] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, (source, placement) in locals_.items():
            buffer = self._buffer(name, source)
            copies.append((buffer, source))
            staged[name] = buffer
            if placement is not None:
                placements[name] = placement
        non_blocking = self.pin
        with torch.no_grad():
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=non_blocking and source.device.type == "cuda")
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return StagedState(tensors=staged, placements=placements)

    def _buffer(self, name: str, source: torch.Tensor) -> torch.Tensor:
        existing = self._buffers.get(name)
        if existing is not None and existing.shape == source.shape and existing.dtype == source.dtype:
            return existing
        if self.pin:  # pinned host memory is page-aligned
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        else:
            buffer = aligned_empty(source.shape, source.dtype)
        self._buffers[name] = buffer
        self.allocations += 1
        return buffer

    def release(self) -> None:
        """Drop every buffer (the memory tier is gone afterwards)."""
        self._buffers.clear()


def stage_tree(stager: Stager, tree: Any) -> Any:
    """Stage every tensor of a nested dict/list state (as DCP passes it) and return the same structure
    with staged tensors; DTensors come back as DTensors over staged local shards. Training thread."""
    found: dict[str, torch.Tensor] = {}

    def collect(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            found[path] = node
        elif isinstance(node, Mapping):
            for key, child in node.items():
                collect(child, f"{path}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                collect(child, f"{path}/{i}")

    collect(tree, "")
    staged = stager.stage(found)

    def rebuild(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            return _restage(node, staged.tensors[path])
        if isinstance(node, Mapping):
            return {key: rebuild(child, f"{path}/{key}") for key, child in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(rebuild(child, f"{path}/{i}") for i, child in enumerate(node))
        return node

    return rebuild(tree, "")


def _restage(original: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    _, placement = local_view(original)
    if placement is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, original.device_mesh, original.placements, run_check=False,
                              shape=original.shape, stride=original.stride())
