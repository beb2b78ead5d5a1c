"""The savers and loaders ``ckptd bench`` compares, each measured the same way.

A :class:`SaveRun` is one save: ``stall`` is the time until the call returned and the state could be
modified, ``durable`` the time until the data was on disk (fsynced/committed), and ``loop_ratio`` the
speed of the compute loop between the two, relative to the undisturbed loop (None when the save is
synchronous). Main thread; each function writes under the directory it is given.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd.bench.workloads import ComputeLoop, evict, fsync_tree, timed
from ckptd.config import override
from ckptd.manager.restoring import restore_state
from ckptd.tiers.local import LocalTier

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


@dataclass(frozen=True)
class SaveRun:
    stall: float
    durable: float
    loop_ratio: float | None = None


def copy_baseline(state: dict[str, torch.Tensor]) -> Callable[[], float]:
    """Time of ``copy_`` into buffers allocated once (the floor for a stall)."""
    buffers = {name: torch.empty_like(t) for name, t in state.items()}

    def run() -> float:
        def copy() -> None:
            for name, tensor in state.items():
                buffers[name].copy_(tensor)
        return timed(copy)

    return run


def torch_save(state: dict[str, torch.Tensor], directory: Path) -> SaveRun:
    path = directory / "model.pt"

    def save() -> None:
        with open(path, "wb") as handle:
            torch.save(state, handle)
        fsync_tree(path)
        fsync_tree(directory)

    seconds = timed(save)
    return SaveRun(stall=seconds, durable=seconds)


def dcp_save(state: dict[str, torch.Tensor], directory: Path, *, threads: int = 4) -> SaveRun:
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(directory), thread_count=threads, sync_files=True)
    seconds = timed(lambda: dcp.save(state, storage_writer=writer))
    return SaveRun(stall=seconds, durable=seconds)


def dcp_async_save(state: dict[str, torch.Tensor], directory: Path, loop: ComputeLoop | None,
                   baseline: float | None) -> SaveRun:
    """DCP's ``async_save`` with its default stager and a FileSystemWriter (sync_files=True)."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(directory), thread_count=1, sync_files=True)
    start = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer)
    stall = time.perf_counter() - start
    ratio = None
    if loop is not None and baseline:
        ratio = loop.run_while(lambda: not future.done()).rate / baseline
    future.result()
    return SaveRun(stall=stall, durable=time.perf_counter() - start, loop_ratio=ratio)


class CkptdContender:
    """One CheckpointManager kept across repeats, as in training (its buffers are reused)."""

    def __init__(self, directory: Path, *, io_threads: int, codec: str = "raw") -> None:
        self.directory, self.io_threads = directory, io_threads
        with override(io_threads=io_threads):
            self.manager = ckptd.CheckpointManager(directory, codec=codec, capture_rng=False,
                                                   policy=ckptd.Policy(keep_local=1))
        self.step = 0

    def save(self, state: dict[str, torch.Tensor], loop: ComputeLoop | None = None,
             baseline: float | None = None) -> SaveRun:
        self.step += 1
        with override(io_threads=self.io_threads):
            start = time.monotonic()
            self.manager.save(self.step, state, force=True)
            stall = time.monotonic() - start
            ratio = None
            if loop is not None and baseline:
                ratio = loop.run_while(lambda: self.manager.busy).rate / baseline
            self.manager.wait()
        committed = self.manager.last_commit  # until the manifest is durable; retention runs after it
        end = committed.committed_at if committed is not None and committed.step == self.step else time.monotonic()
        return SaveRun(stall=stall, durable=end - start, loop_ratio=ratio)

    def prepare_after_restore(self, state: dict[str, torch.Tensor]) -> None:
        """What a job does at its start: ``restore`` (nothing to restore here), which starts preparing the
        staging buffers in the background; then wait until they are ready (training would run meanwhile)."""
        self.manager.restore(state)
        self.manager._saver.stager.wait_prepared(600.0)

    def close(self) -> None:
        self.manager.close()


def first_save_stall(state: dict[str, torch.Tensor], directory: Path, *, io_threads: int, codec: str,
                     prepared: bool) -> float:
    """The stall of a new manager's first save: buffers allocated by the save itself (``prepared`` False)
    or prepared in the background after the job's ``restore`` (True)."""
    contender = CkptdContender(fresh(directory), io_threads=io_threads, codec=codec)
    try:
        if prepared:
            contender.prepare_after_restore(state)
        return contender.save(state).stall
    finally:
        contender.close()


#: What a restore writes into: ``live`` tensors written once before the timer starts, like the parameters
#: of a model built before its restore; ``untouched`` tensors from ``torch.empty_like`` whose pages were
#: never written; ``absent`` (an empty state: ckptd allocates every tensor, as for the state of an
#: optimizer that has not stepped yet). ``torch.load`` always allocates (a ``load_state_dict`` from it
#: would add a copy, which the bench leaves out).
TARGETS = ("live", "untouched", "absent")


def live_targets(state: dict[str, torch.Tensor], kind: str = "live") -> dict[str, torch.Tensor]:
    """Tensors to restore into (see :data:`TARGETS`), made before the timer starts."""
    if kind == "untouched":
        return {name: torch.empty_like(t) for name, t in state.items()}
    if kind == "absent":
        return {}
    return {name: torch.zeros_like(t) for name, t in state.items()}


def restore_torch_load(directory: Path) -> float:
    path = directory / "model.pt"
    evict(path)
    return timed(lambda: torch.load(path, weights_only=True))


def restore_dcp_load(state: dict[str, torch.Tensor], directory: Path) -> float:
    from torch.distributed.checkpoint import FileSystemReader

    target = live_targets(state)
    evict(directory)
    return timed(lambda: dcp.load(target, storage_reader=FileSystemReader(str(directory))))


def restore_ckptd(state: dict[str, torch.Tensor], directory: Path, *, read_threads: int,
                  targets: str = "live") -> float:
    """Read and verify every chunk of the newest step from disk (no memory tier) into ``targets`` (see
    :data:`TARGETS`)."""
    target = live_targets(state, targets)
    evict(directory)
    with override(read_threads=read_threads):
        def restore() -> None:  # the manager's restore path, without taking the writer lock
            restore_state([LocalTier(directory)], target, rank=0, world_size=1, restore_rng=False)
        return timed(restore)


def fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory
