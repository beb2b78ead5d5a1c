"""Prototype for the writer decision: a separate writer process fed through shared memory.

The training process copies the state into shared-memory buffers (the stall), then sends the step
number through a pipe; the writer process hashes (xxh3-128) and writes the buffers in 16 MiB pieces and
fsyncs, as ckptd's writer thread does, and answers when durable. ``ckptd bench --compare-writers``
measures it beside ckptd's thread writer on the same state, so the choice can be rechecked on any
machine. Main thread; one :class:`ProcessWriter` per benchmark.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from ckptd.bench.contenders import SaveRun
from ckptd.bench.workloads import ComputeLoop
from ckptd.format.hashing import chunk_digest
from ckptd.stepio.rank_writer import lower_thread_priority

_PIECE = 16 * 1024 * 1024


def _serve(connection: Any, buffers: dict[str, torch.Tensor], directory: str) -> None:
    torch.set_num_threads(1)
    lower_thread_priority()  # the same priority as ckptd's writer threads
    while True:
        step = connection.recv()
        if step is None:
            return
        final = Path(directory) / f"step-{step:012d}.data"
        temporary = final.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        digests = []
        try:
            for tensor in buffers.values():
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
                for start in range(0, len(view), _PIECE):
                    piece = view[start:start + _PIECE]
                    digests.append(chunk_digest(piece))
                    while piece:
                        piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, final)
        connection.send(len(digests))


class ProcessWriter:
    """A writer process that owns nothing but a pipe and the shared-memory buffers."""

    def __init__(self, state: dict[str, torch.Tensor], directory: Path) -> None:
        context = torch_mp.get_context("spawn")
        self.buffers = {name: torch.empty_like(t).share_memory_() for name, t in state.items()}
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, self.buffers, str(directory)),
                                       name="ckptd-bench-writer", daemon=True)
        self.process.start()
        self.step = 0

    def save(self, state: dict[str, torch.Tensor], loop: ComputeLoop | None = None,
             baseline: float | None = None) -> SaveRun:
        self.step += 1
        start = time.perf_counter()
        for name, tensor in state.items():
            self.buffers[name].copy_(tensor)
        stall = time.perf_counter() - start
        self.connection.send(self.step)
        ratio = None
        if loop is not None and baseline:
            ratio = loop.run_while(lambda: not self.connection.poll()).rate / baseline
        self.connection.recv()
        return SaveRun(stall=stall, durable=time.perf_counter() - start, loop_ratio=ratio)

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(timeout=60)
