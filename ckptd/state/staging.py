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

Fresh memory faults on its first write, page by page: copying 1 GiB into never-touched buffers took
about 10x as long as into written ones on the development machine. :meth:`Stager.prepare` therefore
allocates and pre-faults the buffers of a state whose shapes are known on a background thread
(``ckptd-stager-prepare``), before the first save needs them; the
:class:`~ckptd.manager.manager.CheckpointManager` calls :func:`prepare_state` after a restore and on
the first step it does not save. A ``stage`` that comes while the preparation still runs stops it
after the buffer in progress, uses the buffers that are ready and allocates the others itself.

Thread: :meth:`Stager.stage`, :meth:`Stager.prepare` and :meth:`Stager.release` run on the training
thread; :class:`StagedState` is read-only afterwards and may be read from any thread until the next
``stage``. DTensors are staged as their local shard, with the shard's place in the global tensor (see
:class:`ShardPlacement`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.background import OwnedThread, start_thread
from ckptd.config import settings
from ckptd.format.values import ShardPlacement
from ckptd.errors import ConfigError
from ckptd.state.tree import flatten
from ckptd.stepio.rank_writer import lower_thread_priority
from ckptd.stepio.shared_memory import remove_segment_file, shared_empty
from ckptd.tiers import direct_io
from ckptd.tiers.direct_io import aligned_empty, prefaulted_empty

log = logging.getLogger("ckptd.save")


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


#: The shared-memory segment of every live shared staging buffer of this process (all stagers), by the
#: buffer's data pointer.
_segments: dict[int, str] = {}
_segments_lock = threading.Lock()


def shared_location(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """``(segment name, offset, bytes)`` of a shared staging buffer (see ``Stager(shared=True)``); None for a
    tensor that is none (the writer process cannot read it)."""
    with _segments_lock:
        name = _segments.get(tensor.data_ptr())
    if name is None or tensor.storage_offset() != 0 or not tensor.is_contiguous():
        return None
    return name, 0, tensor.numel() * tensor.element_size()


def _drop_segment(pointer: int, name: str) -> None:
    """A shared buffer was freed: forget its segment and remove its file if the writer never mapped it."""
    with _segments_lock:
        if _segments.get(pointer) == name:
            del _segments[pointer]
    remove_segment_file(name)


@atexit.register
def remove_segment_files() -> None:
    """Remove the files of every shared staging buffer of this process (their memory stays mapped here): at
    exit (a writer process still running removes them too when its trainer is gone)."""
    with _segments_lock:
        names = list(_segments.values())
    for name in names:
        remove_segment_file(name)


def live_segments() -> list[str]:
    """The segments of every live shared staging buffer of this process (the writer process keeps these
    mapped)."""
    with _segments_lock:
        return sorted(_segments.values())


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

    def __init__(self, *, budget_bytes: int | None = None, pin: bool | None = None,
                 shared: bool = False) -> None:
        self.budget_bytes = settings().staging_budget_bytes if budget_bytes is None else budget_bytes
        #: Buffers live in shared-memory segments a writer process maps (the Saver's stager in
        #: ``CKPTD_WRITER_MODE=process``); they are not pinned.
        self.shared = bool(shared)
        want_pin = settings().pin_staging if pin is None else pin
        self.pin = bool(want_pin and not self.shared and torch.cuda.is_available())
        self._buffers: dict[str, torch.Tensor] = {}
        #: Buffers allocated by the preparing thread and not yet used by a ``stage`` (under ``_lock``).
        self._prepared: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._stop_preparing = threading.Event()
        self._preparing: OwnedThread | None = None
        self.allocations = 0
        #: Buffers the preparing thread allocated (whether a stage used them or not).
        self.prepared_allocations = 0

    @property
    def held_bytes(self) -> int:
        """Host memory the buffers take now (prepared ones included)."""
        with self._lock:
            held = list(self._buffers.values()) + list(self._prepared.values())
        return sum(b.numel() * b.element_size() for b in held)

    @property
    def preparing(self) -> bool:
        """Whether a background preparation is still running."""
        thread = self._preparing
        return thread is not None and thread.alive

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Start allocating and pre-faulting, on a background thread, the buffers that a later
        :meth:`stage` of tensors with these names, shapes and dtypes will use; returns how many buffers
        it will prepare. Names that already have a fitting buffer are skipped; nothing is prepared when
        the state exceeds the staging budget (``stage`` then refuses it). A preparation still running
        is stopped first. Only the tensors' shapes and dtypes are read, here, on the calling thread."""
        self._finish_preparing()
        wanted: dict[str, tuple[torch.Size, torch.dtype]] = {}
        needed = 0
        for name, tensor in tensors.items():
            local, _ = local_view(tensor.detach())
            needed += local.numel() * local.element_size()
            if not self._fits(self._buffers.get(name), local) and not self._fits(self._prepared.get(name), local):
                wanted[name] = (local.shape, local.dtype)
        if not wanted or (self.budget_bytes and needed > self.budget_bytes):
            return 0
        self._stop_preparing.clear()
        self._preparing = start_thread("ckptd-stager-prepare", self._prepare, wanted, stop=self._stop_preparing.set)
        return len(wanted)

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Block until the background preparation is done (or ``timeout_s`` passed); returns whether it
        is done. For benchmarks and tests; a save does not need it."""
        thread = self._preparing
        if thread is not None:
            thread.join_within(timeout_s)
        return not self.preparing

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StagedState:
        """Copy every tensor into its buffer and return the staged state (training thread).

        On return the caller may modify the source tensors. The previous :class:`StagedState` is
        overwritten: the caller must make sure no writer still reads it.
        """
        self._finish_preparing()
        locals_: dict[str, tuple[torch.Tensor, ShardPlacement | None]] = {
            name: local_view(tensor.detach()) for name, tensor in tensors.items()}
        needed = sum(t.numel() * t.element_size() for t, _ in locals_.values())
        if self.budget_bytes and needed > self.budget_bytes:
            raise ConfigError(
                f"the state needs {needed} bytes of host memory to stage but the staging budget is "
                f"{self.budget_bytes}", hint="raise CKPTD_STAGING_BUDGET_BYTES or save less state")
        self._forget([self._buffers.pop(name) for name in set(self._buffers) - set(locals_)])
        staged: dict[str, torch.Tensor] = {}
        placements: dict[str, ShardPlacement] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, (source, placement) in locals_.items():
            buffer = self._buffer(name, source)
            copies.append((buffer, source))
            staged[name] = buffer
            if placement is not None:
                placements[name] = placement
        with self._lock:
            unused = list(self._prepared.values())
            self._prepared.clear()  # prepared for a state that is not the one saved
        self._forget(unused)
        non_blocking = self.pin
        with torch.no_grad():
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=non_blocking and source.device.type == "cuda")
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return StagedState(tensors=staged, placements=placements)

    @staticmethod
    def _fits(buffer: torch.Tensor | None, source: torch.Tensor) -> bool:
        return buffer is not None and buffer.shape == source.shape and buffer.dtype == source.dtype

    def _buffer(self, name: str, source: torch.Tensor) -> torch.Tensor:
        existing = self._buffers.get(name)
        if self._fits(existing, source):
            return existing  # type: ignore[return-value]
        with self._lock:
            prepared = self._prepared.pop(name, None)
        buffer = prepared if self._fits(prepared, source) else self._allocate(source.shape, source.dtype)
        self._forget([old for old in (existing, prepared) if old is not None and old is not buffer])
        self._buffers[name] = buffer  # type: ignore[assignment]
        self.allocations += 1
        return buffer  # type: ignore[return-value]

    def _forget(self, buffers: list[torch.Tensor]) -> None:
        """Shared mode: the segment files of dropped buffers go (a writer that mapped one keeps its memory)."""
        if not self.shared:
            return
        with _segments_lock:
            names = [_segments.pop(buffer.data_ptr(), None) for buffer in buffers if buffer.numel()]
        for name in names:
            if name is not None:
                remove_segment_file(name)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, *, prefault: bool = False) -> torch.Tensor:
        if self.shared:
            tensor, segment = shared_empty(shape, dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                with _segments_lock:
                    _segments[tensor.data_ptr()] = segment.name
                weakref.finalize(tensor, _drop_segment, tensor.data_ptr(), segment.name)
                if prefault and not direct_io.prefault(tensor.data_ptr(), nbytes):
                    direct_io.touch_pages(tensor)
            return tensor
        if self.pin:  # pinned host memory is page-aligned, and pinning maps its pages
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        return prefaulted_empty(shape, dtype) if prefault else aligned_empty(shape, dtype)

    def _prepare(self, wanted: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        """The preparing thread: one buffer at a time, until done or told to stop."""
        lower_thread_priority()  # training runs meanwhile and wins contended cores
        try:
            for name, (shape, dtype) in wanted.items():
                if self._stop_preparing.is_set():
                    return
                buffer = self._allocate(shape, dtype, prefault=True)
                with self._lock:
                    self._prepared[name] = buffer
                    self.prepared_allocations += 1
        except Exception as error:  # noqa: BLE001 - a failed preparation only means a slower first save
            log.warning("preparing the staging buffers failed; the next save allocates them: %s", error)

    def stop_preparing(self) -> None:
        """Stop a running preparation after the buffer in progress and wait for its thread (the owner
        calls it when it closes); the buffers prepared so far stay for the next :meth:`stage`. Raises
        StillRunningError when the thread has not ended within ``close_timeout_s``."""
        self._finish_preparing()

    def _finish_preparing(self) -> None:
        thread = self._preparing
        if thread is not None:
            thread.stop_within(settings().close_timeout_s, what="preparing the staging buffers")
            self._preparing = None

    def release(self) -> None:
        """Drop every buffer (the memory tier is gone afterwards)."""
        self._finish_preparing()
        dropped = list(self._buffers.values())
        self._buffers.clear()
        with self._lock:
            dropped += list(self._prepared.values())
            self._prepared.clear()
        self._forget(dropped)


def prepare_state(stager: Stager, state: Mapping[str, Any], *, allow_pickle: bool,
                  select: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None) -> int:
    """:meth:`Stager.prepare` for the tensors a save of ``state`` would stage (same names as
    :class:`~ckptd.manager.saving.Saver` gives them; ``select`` keeps those this rank writes); returns how
    many buffers it will prepare. A state that cannot be flattened (a value that needs pickle when it is not
    allowed, or fails to pickle) prepares nothing: this is an optimisation, and the save reports the
    problem. Training thread."""
    try:
        tensors = flatten(state, allow_pickle=allow_pickle).tensors
        if select is not None:
            tensors = dict(select(tensors))
    except Exception as error:  # noqa: BLE001 - see the docstring
        log.debug("staging buffers not prepared: %s", error)
        return 0
    return stager.prepare(tensors)


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

    restaged = rebuild(tree, "")
    # The nested functions refer to themselves: without this, the staged and source tensors stay alive
    # until the garbage collector finds the cycle (one state's worth of memory per save, save after save).
    del collect, rebuild
    return restaged


def _restage(original: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    _, placement = local_view(original)
    if placement is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, original.device_mesh, original.placements, run_check=False,
                              shape=original.shape, stride=original.stride())
