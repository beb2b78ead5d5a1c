"""Building blocks of ``ckptd bench``: the benchmark state, timers, page-cache eviction, compute loop.

Everything here runs on the calling (main) thread unless a docstring says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


def make_state(total_bytes: int, tensor_bytes: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """An fp32 state of about ``total_bytes`` in tensors of ``tensor_bytes`` (random, incompressible)."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    remaining, index = total_bytes, 0
    while remaining > 0:
        count = max(1, min(tensor_bytes, remaining) // 4)
        state[f"layer{index:03d}.weight"] = torch.randn(count, generator=generator)
        remaining -= count * 4
        index += 1
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def evict(path: Path) -> None:
    """Drop a file's (or every file under a directory's) pages from the page cache: a cold read."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in paths:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories (what a durable save must have done)."""
    for file in [path] if path.is_file() else sorted(path.rglob("*")):
        fd = os.open(file, os.O_RDONLY | (os.O_DIRECTORY if file.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run a block with ``count`` intra-op threads (the compute loop is single-threaded)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class LoopRate:
    """Iterations per second of the compute loop, and for how long it was measured."""

    rate: float
    seconds: float


class ComputeLoop:
    """A single-threaded stand-in for a training step: a matmul chain on one intra-op thread."""

    def __init__(self, size: int = 256) -> None:
        generator = torch.Generator().manual_seed(1)
        self.a = torch.randn(size, size, generator=generator) / size ** 0.5
        self.b = torch.randn(size, size, generator=generator) / size ** 0.5

    def step(self) -> None:
        self.a = torch.tanh(self.a @ self.b)

    def run_for(self, seconds: float) -> LoopRate:
        """Undisturbed rate over about ``seconds``."""
        return self.run_while(lambda: True, min_seconds=seconds, max_seconds=seconds)

    def run_while(self, busy: Callable[[], bool], *, min_seconds: float = 0.0,
                  max_seconds: float = 600.0) -> LoopRate:
        """Rate while ``busy()`` is true (checked every step), for at least ``min_seconds``."""
        with torch_threads(1):
            start = time.perf_counter()
            count, elapsed = 0, 0.0
            while elapsed < max_seconds and (busy() or elapsed < min_seconds):
                self.step()
                count += 1
                elapsed = time.perf_counter() - start
        return LoopRate(count / elapsed if elapsed else float("nan"), elapsed)
