"""The object tier at training cadence (not part of the test run), against moto's S3 server on loopback.

A small model (``--tensors`` tensors, a few MB in all) is changed and saved every step for ``--steps``
steps, with a short stand-in for the training step's compute (``--compute-ms`` of matrix products). Two
cases, interleaved round by round so that a change in machine load hits both alike:

- ``local``: a local tier only;
- ``local+s3``: the same with ``remote=s3://...`` on moto's server.

One more ``local+s3`` run, through a proxy that counts requests, gives the object and request counts.

Reported per case (medians over the rounds): per-step time and save stall (the time ``save()`` blocks
the training thread), median and p90, and their ratio to ``local`` (goal <= 1.1x); for ``local+s3``: steps
promoted and superseded, objects and requests per step on S3, and the promotion lag in steps
(``CheckpointManager.promotion_lag``, sampled after every step: median and max).

moto's server runs on this machine's cores, where a real store would not: by default it is reniced to 19
(``--store-nice 0`` leaves it alone), so that its CPU does not count as the object tier's cost.

With ``--compute-threads 1`` the stand-in compute leaves a core to ckptd's background threads, as a GPU
job's host does; by default it takes every core, and the writer (niced) then barely keeps up with a save
every step.

Usage: ``python benchmarks/bench_object_cadence.py [--steps 60] [--tensors 50] [--rounds 3]
[--compute-threads 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import torch

import ckptd
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.testing.fault_proxy import FaultProxy


def _model(tensors: int, elements: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{index:02d}.weight": torch.randn(elements, generator=generator) for index in range(tensors)}


def _renice_children(nice: int) -> None:
    """Lower the priority of this process's children (moto's server): on this machine the store's CPU
    stands in for another host's, so it must not take the cores the training process would have."""
    if nice <= 0:
        return
    for task in Path("/proc/self/task").glob("*/children"):
        for pid in task.read_text().split():
            try:
                os.setpriority(os.PRIO_PROCESS, int(pid), nice)
            except OSError:
                pass


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _run(root: Path, steps: int, state: dict[str, torch.Tensor], compute_ms: float,
         remote: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """One training run saving every step; returns the per-step timings (and what the uploader did)."""
    work = torch.randn(256, 256)
    options: dict[str, Any] = {}
    if remote is not None:
        options = {"remote": remote[0], "storage_options": remote[1]}
    step_times, stalls, lags = [], [], []
    with ckptd.CheckpointManager(root, capture_rng=False, policy=ckptd.Policy(keep_local=2), **options) as manager:
        for step in range(1, steps + 1):
            started = time.perf_counter()
            deadline = started + compute_ms / 1000
            while time.perf_counter() < deadline:  # the training step's compute
                work = torch.tanh(work @ work) * 0.5
            for tensor in state.values():
                tensor.add_(0.001)
            before_save = time.perf_counter()
            manager.save(step, state)
            ended = time.perf_counter()
            stalls.append(ended - before_save)
            step_times.append(ended - started)
            if remote is not None:
                lags.append(manager.promotion_lag.steps_behind)
        manager.wait_uploads()
        uploader = manager.uploader
        result: dict[str, Any] = {"step_s": step_times, "stall_s": stalls, "lag_steps": lags}
        if uploader is not None:
            result["promoted"] = len(manager.upload_reports)
            result["superseded"] = len(uploader.superseded)
            result["final_lag_steps"] = manager.promotion_lag.steps_behind
    return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median_of(key: str, how: Any) -> float:
        return statistics.median(how(run[key]) for run in runs)

    return {
        "step_ms_median": 1000 * median_of("step_s", statistics.median),
        "step_ms_p90": 1000 * median_of("step_s", lambda values: _percentile(values, 0.9)),
        "stall_ms_median": 1000 * median_of("stall_s", statistics.median),
        "stall_ms_p90": 1000 * median_of("stall_s", lambda values: _percentile(values, 0.9)),
    }


def measure(steps: int, tensors: int, elements: int, rounds: int, compute_ms: float,
            store_nice: int = 19) -> dict[str, Any]:
    state = _model(tensors, elements)
    scratch = Path(tempfile.mkdtemp(prefix="ckptd-cadence-"))
    local_runs: list[dict[str, Any]] = []
    remote_runs: list[dict[str, Any]] = []
    counts: list[dict[str, float]] = []
    try:
        with EmbeddedS3() as server, FaultProxy(server.endpoint_url, fraction=0.0) as proxy:
            _renice_children(store_nice)
            client = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                                  aws_secret_access_key="testing", region_name="us-east-1")
            _run(scratch / "warm", 5, state, compute_ms, None)  # imports, page cache, thread start-up
            for round_number in range(rounds + 1):
                bucket = f"cadence-{uuid.uuid4().hex[:8]}"
                server.create_bucket(bucket)
                if round_number == rounds:  # counting round, through the proxy (not timed: it costs CPU here)
                    run = _run(scratch / "counted", steps, state, compute_ms,
                               (f"s3://{bucket}/run", proxy.storage_options(server.storage_options)))
                    objects = sum(page.get("KeyCount", 0) for page in
                                  client.get_paginator("list_objects_v2").paginate(Bucket=bucket))
                    requests = proxy.counts["requests"]
                    counts.append({"objects_per_promoted_step": objects / max(run["promoted"], 1),
                                   "requests_per_step": requests / steps,
                                   "requests_per_promoted_step": requests / max(run["promoted"], 1)})
                    break
                cases = [("local", None), ("remote", (f"s3://{bucket}/run", server.storage_options))]
                for name, remote in cases if round_number % 2 == 0 else cases[::-1]:
                    run = _run(scratch / f"{name}{round_number}", steps, state, compute_ms, remote)
                    (local_runs if remote is None else remote_runs).append(run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    local, remote = _summary(local_runs), _summary(remote_runs)
    lags = [lag for run in remote_runs for lag in run["lag_steps"]]
    return {
        "steps": steps, "tensors": tensors, "state_mib": sum(t.nbytes for t in state.values()) / 2**20,
        "compute_ms": compute_ms, "rounds": rounds, "store_nice": store_nice,
        "local": local, "local+s3": remote,
        "ratio_step_median": remote["step_ms_median"] / local["step_ms_median"],
        "ratio_stall_median": remote["stall_ms_median"] / max(local["stall_ms_median"], 1e-9),
        "ratio_stall_p90": remote["stall_ms_p90"] / max(local["stall_ms_p90"], 1e-9),
        "promoted_per_run": statistics.median(run["promoted"] for run in remote_runs),
        "superseded_per_run": statistics.median(run["superseded"] for run in remote_runs),
        "objects_per_promoted_step": statistics.median(c["objects_per_promoted_step"] for c in counts),
        "requests_per_step": statistics.median(c["requests_per_step"] for c in counts),
        "requests_per_promoted_step": statistics.median(c["requests_per_promoted_step"] for c in counts),
        "lag_steps_median": statistics.median(lags), "lag_steps_max": max(lags),
        "final_lag_steps": max(run["final_lag_steps"] for run in remote_runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--elements", type=int, default=20_000, help="float32 elements per tensor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compute-ms", type=float, default=30.0, help="stand-in compute per training step")
    parser.add_argument("--store-nice", type=int, default=19,
                        help="nice value for moto's server process (0: leave it; it stands in for a remote store)")
    parser.add_argument("--compute-threads", type=int, default=0,
                        help="torch threads of the stand-in compute (0: torch's default, every core)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.compute_threads > 0:
        torch.set_num_threads(args.compute_threads)
    result = measure(args.steps, args.tensors, args.elements, args.rounds, args.compute_ms, args.store_nice)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['tensors']} tensors, {result['state_mib']:.1f} MiB, saved every step for {result['steps']} "
          f"steps, {result['compute_ms']:g} ms compute per step, {result['rounds']} rounds (medians), "
          f"moto at nice {result['store_nice']}")
    for case in ("local", "local+s3"):
        row = result[case]
        print(f"  {case:9s} step {row['step_ms_median']:6.1f} ms (p90 {row['step_ms_p90']:6.1f})   "
              f"save stall {row['stall_ms_median']:6.2f} ms (p90 {row['stall_ms_p90']:6.2f})")
    print(f"  ratio local+s3 / local: step {result['ratio_step_median']:.2f}x, stall median "
          f"{result['ratio_stall_median']:.2f}x, stall p90 {result['ratio_stall_p90']:.2f}x")
    print(f"  per run: {result['promoted_per_run']:g} steps promoted, {result['superseded_per_run']:g} superseded; "
          f"{result['objects_per_promoted_step']:.1f} objects and {result['requests_per_promoted_step']:.1f} "
          f"requests per promoted step ({result['requests_per_step']:.1f} per training step)")
    print(f"  promotion lag: median {result['lag_steps_median']:g} steps, max {result['lag_steps_max']}, "
          f"after wait_uploads {result['final_lag_steps']}")


if __name__ == "__main__":
    main()
