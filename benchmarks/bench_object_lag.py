"""How far the object tier trails a real training loop, and what S3 costs the loop (not part of the test run).

A nanoGPT-like model (``small``: about 109k parameters; ``10m``: about 10.7M, nanoGPT's Shakespeare-char
shape) trains with AdamW and is saved (model and optimizer) every ``--every`` steps. Two cases, interleaved
round by round so that a change in machine load hits both alike:

- ``local``: a local tier only;
- ``local+s3``: the same with ``remote=s3://...`` on moto's server, reniced to 19 (it stands for another
  host; on this machine its CPU must not count as the object tier's cost).

Reported per model (medians over the rounds): the per-step time of each case and their ratio (goal <= 1.1x),
the save stall; for ``local+s3``: the loop step at which the first upload landed, the lag in steps
(``CheckpointManager.promotion_lag`` after every step: median, p90, max) and in seconds (from each commit to
the landing of the upload that covers it: median, max), the steps promoted and superseded, and whether the
newest step was on S3 after ``close()``.

Usage: ``python benchmarks/bench_object_lag.py [--models small,10m] [--steps 60] [--every 5] [--rounds 2]
[--threads 1] [--store-nice 19] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckptd
from ckptd.embedded_s3 import EmbeddedS3

MODELS = {"small": (46, 4, 2, 64), "10m": (384, 6, 6, 64)}  # width, layers, heads, context


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _model(name: str, vocab: int = 65) -> nn.Module:
    width, layers, heads, _ = MODELS[name]
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, width), *[_Block(width, heads) for _ in range(layers)],
                         nn.LayerNorm(width), nn.Linear(width, vocab))


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _run(name: str, root: Path, steps: int, every: int, remote: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """One training run; returns per-step timings and, with a remote, the lag it showed."""
    model = _model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options: dict[str, Any] = {} if remote is None else {"remote": remote[0], "storage_options": remote[1]}
    generator = torch.Generator().manual_seed(1)
    step_times, stalls, lags = [], [], []
    committed_at: dict[int, float] = {}
    landed_at: dict[int, tuple[float, int]] = {}
    loop = {"step": 0}
    first_landed: int | None = None
    context = MODELS[name][3]
    with ckptd.CheckpointManager(root, capture_rng=False, daemon="off", policy=ckptd.Policy(keep_local=2),
                                 **options) as manager:
        uploader = manager.uploader
        lock = threading.Lock()
        if uploader is not None:
            manager._saver.on_commit.insert(0, lambda step: committed_at.__setitem__(step, time.monotonic()))
            promote = uploader.promoter.promote

            def timed(step: int, **kwargs: Any) -> Any:
                report = promote(step, **kwargs)
                with lock:
                    landed_at[step] = (time.monotonic(), loop["step"])
                return report

            uploader.promoter.promote = timed  # type: ignore[method-assign]
        for step in range(1, steps + 1):
            started = time.perf_counter()
            tokens = torch.randint(0, 65, (8, context), generator=generator)
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 65), tokens.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stall = 0.0
            if step % every == 0:
                before = time.perf_counter()
                manager.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                stall = time.perf_counter() - before
                stalls.append(stall)
            step_times.append(time.perf_counter() - started)
            with lock:
                loop["step"] = step
            if uploader is not None:
                lags.append(uploader.lag.steps_behind)
                if first_landed is None and landed_at:
                    first_landed = step
        closing = time.perf_counter()
    result: dict[str, Any] = {"step_s": step_times, "stall_s": stalls, "close_s": time.perf_counter() - closing}
    if remote is not None:
        landed = sorted((at, step) for step, (at, _) in landed_at.items())
        seconds = []
        for step, at in committed_at.items():  # a commit is covered by the first upload of it or a newer step
            covering = [when for when, promoted in landed if promoted >= step]
            if covering:
                seconds.append(min(covering) - at)
        result.update(lag_steps=lags, lag_s=seconds, first_landed_step=first_landed,
                      promoted=len(landed), superseded=len(uploader.superseded) if uploader else 0,
                      newest_on_s3=max(landed_at, default=None) == max(committed_at, default=None))
    return result


def measure(name: str, steps: int, every: int, rounds: int, store_nice: int = 19) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="ckptd-object-lag-"))
    local_runs: list[dict[str, Any]] = []
    remote_runs: list[dict[str, Any]] = []
    try:
        with EmbeddedS3() as server:
            assert server._process is not None
            os.setpriority(os.PRIO_PROCESS, server._process.pid, store_nice)
            _run(name, scratch / "warm", every, every, None)  # imports, page cache
            for round_number in range(rounds):
                bucket = f"lag-{uuid.uuid4().hex[:8]}"
                server.create_bucket(bucket)
                cases = [(None, local_runs), ((f"s3://{bucket}/run", server.storage_options), remote_runs)]
                for remote, runs in cases if round_number % 2 == 0 else cases[::-1]:
                    runs.append(_run(name, scratch / f"{'s3' if remote else 'local'}{round_number}", steps, every,
                                     remote))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    params = sum(parameter.numel() for parameter in _model(name).parameters())

    def med(runs: list[dict[str, Any]], key: str, how: Any) -> float:
        return statistics.median(how(run[key]) for run in runs if run[key])

    local_step = med(local_runs, "step_s", statistics.median)
    remote_step = med(remote_runs, "step_s", statistics.median)
    lags = [lag for run in remote_runs for lag in run["lag_steps"]]
    seconds = [value for run in remote_runs for value in run["lag_s"]]
    return {
        "model": name, "parameters": params, "steps": steps, "every": every, "rounds": rounds,
        "local_step_ms": 1000 * local_step, "s3_step_ms": 1000 * remote_step, "step_ratio": remote_step / local_step,
        "local_stall_ms": 1000 * med(local_runs, "stall_s", statistics.median),
        "s3_stall_ms": 1000 * med(remote_runs, "stall_s", statistics.median),
        "first_upload_landed_at_step": [run["first_landed_step"] for run in remote_runs],
        "lag_steps_median": statistics.median(lags), "lag_steps_p90": _percentile(lags, 0.9),
        "lag_steps_max": max(lags),
        "lag_s_median": statistics.median(seconds) if seconds else None, "lag_s_max": max(seconds, default=None),
        "promoted": [run["promoted"] for run in remote_runs], "superseded": [run["superseded"] for run in remote_runs],
        "newest_on_s3_after_close": all(run["newest_on_s3"] for run in remote_runs),
        "close_s_s3": [round(run["close_s"], 2) for run in remote_runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,10m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    parser.add_argument("--store-nice", type=int, default=19, help="nice value of moto's server (19: lowest)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        result = measure(name, args.steps, args.every, args.rounds, args.store_nice)
        if args.json:
            print(json.dumps(result))
            continue
        print(f"{name} ({result['parameters']:,} parameters, saved every {args.every} of {args.steps} steps, "
              f"{args.rounds} rounds)")
        print(f"  per-step time: local {result['local_step_ms']:.1f} ms, local+s3 {result['s3_step_ms']:.1f} ms "
              f"-> {result['step_ratio']:.2f}x; save stall {result['local_stall_ms']:.1f} / "
              f"{result['s3_stall_ms']:.1f} ms")
        print(f"  first upload landed at loop step {result['first_upload_landed_at_step']}; lag in steps median "
              f"{result['lag_steps_median']}, p90 {result['lag_steps_p90']}, max {result['lag_steps_max']}; "
              f"commit-to-S3 median {result['lag_s_median']} s, max {result['lag_s_max']} s")
        print(f"  promoted {result['promoted']}, superseded {result['superseded']}, newest on S3 after close: "
              f"{result['newest_on_s3_after_close']}")


if __name__ == "__main__":
    main()
