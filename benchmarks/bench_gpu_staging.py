"""GPU staging check (not part of the test run; needs a CUDA device): how long a save holds training up
when the state lives on the GPU.

On one state of bf16 tensors on the device, in the same run:

1. the card's pinned device-to-host bandwidth: ``copy_(non_blocking=True)`` of one large tensor into a
   pinned host buffer allocated beforehand, then a synchronize (the ceiling for any stager);
2. ``tensor.to("cpu")`` of every tensor (pageable memory, allocated on every call);
3. DCP ``async_save`` with its ``DefaultStager`` (pinned memory, non-blocking copies, staging in the
   background): the time until the call returns and the time until staging completes, which is when
   the state may change;
4. ckptd: ``CheckpointManager.save`` (pinned, reused staging buffers; ``save`` returns once the copy is
   done, so its return is when the state may change). The first save allocates the buffers and is
   reported apart, beside the first save of a manager whose ``restore`` (nothing to restore) prepared
   the buffers in the background first, as at the start of a job.

Stalls are reported in seconds and as the device-to-host bandwidth they amount to, relative to (1).
Every save of (3) and (4) also writes the state to ``--dir`` in the background, and the next one waits
for it: keep ``--gib`` within the disk.

Usage: ``python benchmarks/bench_gpu_staging.py [--gib 16] [--tensor-mib 256] [--repeats 2] [--json]``;
``--device cpu --gib 0.25`` runs the same code paths without a GPU (unpinned), as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import ckptd
from ckptd.bench.workloads import timed

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
GIB = 1 << 30


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_on(device: str, action: Callable[[], object]) -> float:
    """Seconds of ``action`` including the device work it queued."""
    synchronize(device)
    return timed(lambda: (action(), synchronize(device)))


def make_state(gib: float, tensor_mib: int, device: str) -> dict[str, torch.Tensor]:
    per_tensor = tensor_mib * (1 << 20) // 2  # bf16 elements
    count = max(1, round(gib * GIB / (per_tensor * 2)))
    generator = torch.Generator(device=device).manual_seed(0)
    return {f"layer{i:04d}.weight": torch.randn(per_tensor, generator=generator, device=device,
                                                dtype=torch.float32).to(torch.bfloat16) for i in range(count)}


def pinned_bandwidth(state: dict[str, torch.Tensor], device: str, repeats: int) -> float:
    """Seconds per byte-normalised copy of the largest tensor into one pinned buffer, as GB/s."""
    source = max(state.values(), key=lambda t: t.numel())
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=device == "cuda")
    seconds = min(timed_on(device, lambda: target.copy_(source, non_blocking=True)) for _ in range(repeats + 1))
    return source.numel() * source.element_size() / seconds / 1e9


def to_cpu(state: dict[str, torch.Tensor], device: str) -> float:
    return timed_on(device, lambda: {name: t.to("cpu") for name, t in state.items()})


def dcp_async(state: dict[str, torch.Tensor], directory: Path, stager: DefaultStager, device: str) -> dict[str, float]:
    shutil.rmtree(directory, ignore_errors=True)
    writer = FileSystemWriter(str(directory), thread_count=4, sync_files=True)
    synchronize(device)
    start = time.perf_counter()
    response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
    returned = time.perf_counter() - start
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()
    staged = time.perf_counter() - start
    upload = getattr(response, "upload_completion", response)
    upload.result()
    return {"returned": returned, "staged": staged}


def ckptd_save(manager: ckptd.CheckpointManager, step: int, state: dict[str, torch.Tensor], device: str) -> float:
    seconds = timed_on(device, lambda: manager.save(step, state, force=True))
    manager.wait()
    return seconds


def release_pinned_cache() -> None:
    """Hand cached pinned host blocks back, so that the next first save allocates afresh."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None and torch.cuda.is_available():
        release()


def ckptd_first_save_prepared(directory: Path, state: dict[str, torch.Tensor], device: str) -> float:
    """A new manager's first save after its ``restore`` prepared the staging buffers in the background."""
    manager = ckptd.CheckpointManager(directory, capture_rng=False, policy=ckptd.Policy(keep_local=1))
    try:
        manager.restore(state)
        manager._saver.stager.wait_prepared(600.0)  # training would run meanwhile
        return ckptd_save(manager, 1, state, device)
    finally:
        manager.close()


def run(options: argparse.Namespace) -> dict[str, Any]:
    device = options.device
    state = make_state(options.gib, options.tensor_mib, device)
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="ckptd-gpu-", dir=options.dir))
    try:
        peak = pinned_bandwidth(state, device, options.repeats)
        to_cpu_s = [to_cpu(state, device) for _ in range(options.repeats)]
        stager = DefaultStager(StagingOptions(use_pinned_memory=device == "cuda", use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=device == "cuda"))
        dcp_runs = [dcp_async(state, root / "dcp", stager, device) for _ in range(options.repeats + 1)]
        stager.close()
        shutil.rmtree(root / "dcp", ignore_errors=True)
        release_pinned_cache()
        prepared_s = ckptd_first_save_prepared(root / "ckptd_prepared", state, device)
        shutil.rmtree(root / "ckptd_prepared", ignore_errors=True)
        release_pinned_cache()
        manager = ckptd.CheckpointManager(root / "ckptd", capture_rng=False, policy=ckptd.Policy(keep_local=1))
        ckptd_s = [ckptd_save(manager, step, state, device) for step in range(1, options.repeats + 2)]
        manager.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def summary(seconds: float) -> dict[str, float]:
        gbps = state_bytes / seconds / 1e9
        return {"seconds": seconds, "gb_per_s": gbps, "of_pinned_peak": gbps / peak}

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_bytes": state_bytes, "tensors": len(state), "pinned_peak_gb_per_s": peak,
        "tensor_to_cpu": summary(statistics.median(to_cpu_s)),
        "dcp_async_save_returns": summary(statistics.median(r["returned"] for r in dcp_runs[1:])),
        "dcp_async_save_staged": summary(statistics.median(r["staged"] for r in dcp_runs[1:])),
        "dcp_first_staged_s": dcp_runs[0]["staged"],
        "ckptd_save_stall": summary(statistics.median(ckptd_s[1:])),
        "ckptd_first_save_stall_s": ckptd_s[0],
        "ckptd_first_save_prepared_s": prepared_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=16.0, help="state size in GiB of bf16")
    parser.add_argument("--tensor-mib", type=int, default=256, help="size of each tensor")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per case (medians)")
    parser.add_argument("--dir", default=None, help="directory for the background writes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_staging: no CUDA device is available; run it on a GPU machine "
                 "(or pass --device cpu for a smoke test)")
    report = run(options)
    if options.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}: {report['state_bytes'] / GIB:.2f} GiB bf16 in {report['tensors']} tensors; "
          f"pinned device-to-host peak {report['pinned_peak_gb_per_s']:.1f} GB/s")
    for key in ("tensor_to_cpu", "dcp_async_save_returns", "dcp_async_save_staged", "ckptd_save_stall"):
        row = report[key]
        print(f"  {key:24s} {row['seconds']:8.3f} s  {row['gb_per_s']:6.1f} GB/s  {row['of_pinned_peak']:.2f} of peak")
    print(f"  first stalls (allocating): DCP staged {report['dcp_first_staged_s']:.3f} s, "
          f"ckptd {report['ckptd_first_save_stall_s']:.3f} s, ckptd with buffers prepared after restore "
          f"{report['ckptd_first_save_prepared_s']:.3f} s")


if __name__ == "__main__":
    main()
