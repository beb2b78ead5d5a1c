"""Bandwidths measured on this machine for ``ckptd plan --measure``: short, bounded runs of a few hundred MiB.

- host memory: a buffer copied (numpy) by as many threads at once as the node has ranks (at most this
  machine's cores), the median of ``repeats`` copies: the node's ranks stage in parallel;
- device to host: a pinned copy from the first CUDA device, when torch sees one (else not measured);
- disk: writing ``nbytes`` to a file in ``--local DIR`` in 8 MiB pieces (stopping after about 20 s on a
  slow disk), then fsync; the file is removed;
- object store: one upload of ``nbytes`` to the given URL through ckptd's tier (the same client a save
  uses), then the object is deleted (also when the upload failed).

Each function returns GB/s (1e9 bytes/s). Main thread; each run is one pass over ``nbytes``.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from ckptd.background import run_jobs
from ckptd.errors import CkptdError, ConfigError, StorageError

log = logging.getLogger(__name__)

_PIECE = 8 << 20


def host_memcpy_gbps(nbytes: int, *, repeats: int = 3, copiers: int = 1) -> float:
    """Median GB/s of copying ``nbytes`` between two host buffers (after one warm-up copy), by ``copiers``
    threads at once, each copying its share (numpy releases the GIL while it copies), as a node's ranks
    stage at the same time."""
    import numpy as np

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    bounds = [nbytes * part // max(1, copiers) for part in range(max(1, copiers) + 1)]
    shares = [functools.partial(np.copyto, target[low:high], source[low:high])
              for low, high in zip(bounds, bounds[1:])]

    def copy_all() -> float:
        start = time.perf_counter()
        if len(shares) == 1:
            shares[0]()
        else:
            run_jobs(shares, threads=len(shares), thread_name_prefix="ckptd-plan-copy")
        return time.perf_counter() - start

    copy_all()
    times = [copy_all() for _ in range(max(1, repeats))]
    return nbytes / statistics.median(times) / 1e9


def device_to_host_gbps(nbytes: int, *, repeats: int = 3) -> float | None:
    """Median GB/s of a pinned device-to-host copy on CUDA device 0, or None without torch or a CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def disk_gbps(directory: str | Path, nbytes: int, *, deadline_s: float = 20.0) -> float:
    """GB/s of writing ``nbytes`` into ``directory`` and fsyncing it (the probe file is removed after);
    a slow disk stops after about ``deadline_s`` seconds and the bytes written by then count."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError("--local must name an existing directory to measure its disk", path=str(directory))
    piece = memoryview(os.urandom(min(_PIECE, nbytes)))
    path = directory / f".ckptd-plan-probe-{uuid.uuid4().hex}"
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as handle:
            written = 0
            while written < nbytes and (not written or time.perf_counter() - start < deadline_s):
                written += handle.write(piece[:min(nbytes - written, len(piece))])
            os.fsync(handle.fileno())
        elapsed = time.perf_counter() - start
    except OSError as exc:
        raise StorageError(f"cannot write the disk probe: {exc.strerror or exc}", path=str(path), tier="local",
                           hint="give --disk-gb-per-s instead of measuring") from exc
    finally:
        path.unlink(missing_ok=True)
    return written / elapsed / 1e9


def object_gbps(url: str, nbytes: int, *, storage_options: dict[str, Any] | None = None) -> float:
    """GB/s of uploading one object of ``nbytes`` under ``url`` (deleted after) through ckptd's tier."""
    from ckptd.tiers import open_tier

    tier = open_tier(url, storage_options=storage_options)
    name = f"ckptd-plan-probe-{uuid.uuid4().hex}"
    data = os.urandom(nbytes)
    try:
        start = time.perf_counter()
        tier.write_bytes(name, data)
        elapsed = time.perf_counter() - start
    finally:
        try:
            tier.delete_files([name])  # also after a failed or interrupted upload that may have landed
        except CkptdError as error:
            log.warning("could not delete the object probe %s: %s", name, error)
        finally:
            tier.close()
    return nbytes / elapsed / 1e9
