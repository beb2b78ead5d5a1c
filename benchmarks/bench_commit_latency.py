"""Commit latency: the time from ``save()`` returning to the local commit (not part of the test run).

A 2 MB state (``--mb``) is changed and saved every step of a training-loop stand-in, for ``--steps`` steps
per case. Between steps the main thread either

- ``idle``: sleeps (the baseline: the same write beside an idle loop, no other load),
- ``gil``: runs pure-Python arithmetic that holds the GIL the whole time, or
- ``torch``: runs matrix products (torch ops, which release the GIL),

each step lasting about ``--step-ms`` on an idle machine. In the ``gil`` and ``torch`` cases every other
core runs a CPU-bound process at normal priority (as data-loader workers keep a real node busy). Writers:
``thread`` (``CKPTD_WRITER_MODE=thread``: the writer thread of the training process at
``CKPTD_BACKGROUND_NICE``) and ``process`` (``CKPTD_WRITER_MODE=process``) at
``CKPTD_WRITER_PROCESS_NICE`` 0 and 10.

Per case: commit latency (``CheckpointManager.last_commit.seconds`` of every step) p50/p99 and their ratio
to the idle-loop write of the same writer (goal <= 2x), steps elapsed at the commit (p50/max), and the
stall of ``save()`` p50/p99 (in the idle rows: the stall alone, each save made once the previous one is
committed; in the others it includes back-pressure, a save waiting for the previous write). Cases run one after another in this process; the idle baseline is measured in
the same run.

Usage: ``python benchmarks/bench_commit_latency.py [--steps 60] [--mb 2] [--step-ms 50] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import ckptd
from ckptd.config import override


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _gil_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def _torch_work(a: torch.Tensor, products: int) -> None:
    for _ in range(products):
        torch.mm(a, a)


def _calibrate(step_ms: float) -> tuple[int, int]:
    """Pure-Python iterations and matrix products that take about ``step_ms`` each, on this machine now."""
    start = time.perf_counter()
    _gil_work(200_000)
    per_iteration = (time.perf_counter() - start) / 200_000
    a = torch.randn(256, 256)
    start = time.perf_counter()
    _torch_work(a, 20)
    per_product = (time.perf_counter() - start) / 20
    return max(1, int(step_ms / 1000 / per_iteration)), max(1, int(step_ms / 1000 / per_product))


def _burners(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(count)]


def run_case(loop: str, writer: str, nice: int, *, steps: int, mb: float, iterations: int, products: int,
             step_ms: float, busy: int) -> dict[str, Any]:
    state = {"w": torch.randn(int(mb * 1024 * 1024 / 4))}
    a = torch.randn(256, 256)
    records: list[Any] = []
    stalls: list[float] = []
    burners = _burners(busy)
    try:
        with override(writer_mode=writer, writer_process_nice=nice), tempfile.TemporaryDirectory() as root:
            manager = ckptd.CheckpointManager(root, capture_rng=False, policy=ckptd.Policy(keep_local=2))
            saver = manager._saver
            saver.on_commit.append(lambda step: records.append(saver.last_commit))
            manager.save(0, state, durable=True)  # the writer (process) is up, the buffers allocated
            records.clear()
            for step in range(1, steps + 1):
                state["w"][step] += 1.0
                start = time.perf_counter()
                manager.save(step, state)
                stalls.append(time.perf_counter() - start)
                if loop == "gil":
                    _gil_work(iterations)
                elif loop == "torch":
                    _torch_work(a, products)
                else:
                    time.sleep(step_ms / 1000)
            manager.wait()
            manager.close()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    latencies = [r.seconds for r in records if r is not None]
    if loop == "idle":  # the stall alone: save() once the previous step is committed (no back-pressure)
        with override(writer_mode=writer, writer_process_nice=nice), tempfile.TemporaryDirectory() as root:
            with ckptd.CheckpointManager(root, capture_rng=False) as manager:
                manager.save(0, state, durable=True)
                alone = []
                for step in range(1, steps + 1):
                    state["w"][step] += 1.0
                    start = time.perf_counter()
                    manager.save(step, state)
                    alone.append(time.perf_counter() - start)
                    manager.wait()
        stalls = alone
    elapsed = [r.steps_elapsed for r in records if r is not None]
    return {"loop": loop, "writer": writer, "nice": nice if writer == "process" else None, "busy_cores": busy,
            "commits": len(latencies),
            "latency_p50_ms": 1000 * statistics.median(latencies), "latency_p99_ms": 1000 * _percentile(latencies, 0.99),
            "steps_elapsed_p50": statistics.median(elapsed), "steps_elapsed_max": max(elapsed),
            "stall_p50_ms": 1000 * statistics.median(stalls), "stall_p99_ms": 1000 * _percentile(stalls, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mb", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--busy", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="CPU-bound processes beside the gil and torch loops (default: cores - 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    iterations, products = _calibrate(args.step_ms)
    common = dict(steps=args.steps, mb=args.mb, iterations=iterations, products=products, step_ms=args.step_ms)
    cases = [("idle", "thread", 0, 0), ("idle", "process", 0, 0)]
    for loop in ("gil", "torch"):
        cases += [(loop, "thread", 0, args.busy), (loop, "process", 0, args.busy), (loop, "process", 10, args.busy)]
    results = [run_case(loop, writer, nice, busy=busy, **common) for loop, writer, nice, busy in cases]
    idle = {r["writer"]: r for r in results if r["loop"] == "idle"}
    for r in results:
        base = idle[r["writer"]]
        r["ratio_p50"] = r["latency_p50_ms"] / base["latency_p50_ms"]
        r["ratio_p99"] = r["latency_p99_ms"] / base["latency_p99_ms"]
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "args": vars(args), "results": results}, indent=2))
        return
    print(f"{os.cpu_count()} cores, {args.mb:g} MB saved every step, {args.steps} steps, ~{args.step_ms:g} ms a step, "
          f"{args.busy} busy process(es) beside the gil/torch loops")
    print(f"{'loop':6} {'writer':8} {'nice':>4} {'p50 ms':>8} {'p99 ms':>8} {'x idle p50':>10} {'x idle p99':>10} "
          f"{'steps p50':>9} {'steps max':>9} {'stall p50':>9} {'stall p99':>9}")
    for r in results:
        print(f"{r['loop']:6} {r['writer']:8} {'' if r['nice'] is None else r['nice']:>4} {r['latency_p50_ms']:8.1f} "
              f"{r['latency_p99_ms']:8.1f} {r['ratio_p50']:10.2f} {r['ratio_p99']:10.2f} {r['steps_elapsed_p50']:9g} "
              f"{r['steps_elapsed_max']:9d} {r['stall_p50_ms']:9.2f} {r['stall_p99_ms']:9.2f}")


if __name__ == "__main__":
    main()
