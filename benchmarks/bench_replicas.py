"""Benchmark of replicas written once (not part of the test run): dp replicas of one state on real gloo ranks.

Every rank holds the same state (``--mib`` MiB per replica in ``--tensors`` float32 tensors, DDP-style). Three
contenders save it, in interleaved rounds, each into its own directory on the same disk:

- ``ckptd-once``: ``CheckpointManager(layout=Layout(mesh={"dp": N}, replicated=("dp",)))``: each tensor is
  staged and written by one rank, spread by bytes;
- ``ckptd-every-rank``: the same with ``write_replicas="every-rank"`` (the behaviour before layouts);
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (its default planner writes a
  replicated tensor once too).

Reported per contender: bytes written (all ranks, from the files on disk), bytes of the busiest rank, the
durable save time (from the save call until the step is committed and fsynced on every rank, the slowest
rank, best round) and, for ckptd, the stall (until ``save()`` returned); then ratios against ckptd-once.
Each ckptd manager saves a warm-up step first (its staging buffers are allocated once per run).

Usage: ``python benchmarks/bench_replicas.py [--ranks 2] [--mib 512] [--tensors 16] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckptd
from ckptd.testing import run_multirank

CONTENDERS = ("ckptd-once", "ckptd-every-rank", "dcp")


def _state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    elements = mib * 1024 * 1024 // 4 // tensors
    return {f"layer{i}.weight": torch.randn(elements, generator=generator) for i in range(tensors)}


def _files_bytes(root: Path, rank: int | None = None) -> int:
    pattern = "**/*" if rank is None else f"**/rank-{rank:05d}*.data"
    return sum(path.stat().st_size for path in root.glob(pattern) if path.is_file())


def _rank(rank: int, world_size: int, scratch: str, mib: int, tensors: int, rounds: int) -> dict[str, Any]:
    state = {"model": _state(mib, tensors)}
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    managers = {
        name: ckptd.CheckpointManager(Path(scratch) / name, layout=layout, write_replicas=mode, codec="raw",
                                      capture_rng=False, policy=ckptd.Policy(keep_local=1))
        for name, mode in (("ckptd-once", "once"), ("ckptd-every-rank", "every-rank"))}
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
    written: dict[str, dict[str, int]] = {}
    try:
        for manager in managers.values():
            manager.save(0, state, force=True)
            manager.wait()
        for step in range(1, rounds + 1):
            for name in CONTENDERS:
                dist.barrier()
                started = time.perf_counter()
                if name == "dcp":
                    import torch.distributed.checkpoint as dcp

                    directory = Path(scratch) / name / f"step-{step}"
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)))
                    stalled = time.perf_counter() - started
                else:
                    managers[name].save(step, state, force=True)
                    stalled = time.perf_counter() - started
                    managers[name].wait()
                durable = time.perf_counter() - started
                dist.barrier()
                timings[name].append((stalled, durable))
                if rank == 0:
                    root = Path(scratch) / name
                    step_root = root / f"step-{step}" if name == "dcp" else root / f"step-{step:012d}"
                    written[name] = {"total": _files_bytes(step_root),
                                     "busiest": max(_files_bytes(step_root, r) for r in range(world_size))
                                     if name != "dcp" else max(
                                         sum(p.stat().st_size for p in step_root.glob(f"__{r}_*.distcp"))
                                         for r in range(world_size))}
                    if name == "dcp" and step > 1:
                        shutil.rmtree(root / f"step-{step - 1}", ignore_errors=True)
                dist.barrier()
    finally:
        for manager in managers.values():
            manager.close()
    return {"timings": timings, "written": written}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        results = run_multirank(_rank, args.ranks, scratch, args.mib, args.tensors, args.rounds, timeout_s=1800)
    report: dict[str, Any] = {"ranks": args.ranks, "mib_per_replica": args.mib, "tensors": args.tensors,
                              "rounds": args.rounds, "contenders": {}}
    for name in CONTENDERS:
        durable = [max(result["timings"][name][i][1] for result in results) for i in range(args.rounds)]
        stall = [max(result["timings"][name][i][0] for result in results) for i in range(args.rounds)]
        report["contenders"][name] = {
            "bytes_written": results[0]["written"][name]["total"],
            "busiest_rank_bytes": results[0]["written"][name]["busiest"],
            "durable_s_best": min(durable), "durable_s_median": sorted(durable)[len(durable) // 2],
            "stall_s_best": min(stall)}
    base = report["contenders"]["ckptd-once"]
    for name, row in report["contenders"].items():
        row["bytes_vs_once"] = row["bytes_written"] / base["bytes_written"]
        row["durable_vs_once"] = row["durable_s_best"] / base["durable_s_best"]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.ranks} dp replicas x {args.mib} MiB ({args.tensors} tensors), best of {args.rounds} rounds")
    print(f"{'CONTENDER':<18} {'WRITTEN MiB':>12} {'BUSIEST MiB':>12} {'DURABLE s':>10} {'STALL s':>8} "
          f"{'BYTES x':>8} {'TIME x':>7}")
    for name, row in report["contenders"].items():
        print(f"{name:<18} {row['bytes_written'] / 2**20:>12.1f} {row['busiest_rank_bytes'] / 2**20:>12.1f} "
              f"{row['durable_s_best']:>10.3f} {row['stall_s_best']:>8.3f} {row['bytes_vs_once']:>8.2f} "
              f"{row['durable_vs_once']:>7.2f}")


if __name__ == "__main__":
    main()
