"""Run a function on N real processes joined in a gloo process group, with a deadline.

:func:`run_multirank` starts ``world_size`` processes (from a fork server that has imported torch
once, so each start is cheap), initialises ``torch.distributed`` with gloo over a free loopback port
in each, calls ``fn(rank, world_size, *args)``, and returns the results by rank. A process that raises
sends its traceback back; the helper then raises :class:`~ckptd.errors.WorkerError` with one failure per
rank. Processes still running at the deadline are killed (SIGKILL) and reported as timed out.

``fn`` and ``args`` must be picklable: define ``fn`` at module level. Call from the main thread.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ckptd.errors import WorkerError

_context: Any = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed", "ckptd"])
    return _context


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
           timeout_s: float, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as error:  # sent to the parent, which raises it with the rank
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank."""
    context = _mp_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_child, args=(fn, rank, world_size, port, args, timeout_s, results),
                                 name=f"ckptd-test-rank{rank}", daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if not process.is_alive() and rank not in values and rank not in failures \
                            and process.exitcode not in (0, None):
                        failures[rank] = f"process exited with code {process.exitcode}"
                        deadline = min(deadline, time.monotonic() + 15.0)
                continue
            (values if ok else failures)[rank] = value
            if failures:  # the others may now block in a collective: give them a short grace period
                deadline = min(deadline, time.monotonic() + 15.0)
    finally:
        for rank, process in enumerate(processes):
            process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if process.is_alive():
                process.kill()
                process.join()
                if rank not in values:
                    failures.setdefault(rank, f"no result within {timeout_s} s (killed)")
    if failures:
        raise WorkerError(f"{len(failures)} of {world_size} rank(s) failed", failures)
    return [values[rank] for rank in range(world_size)]
