"""Save stall per checkpoint under Lightning with a resumable loader, saves inside the epoch (not a test).

:mod:`bench_lightning` measures the stall of ckptd's ``CkptdCheckpointIO`` against Lightning's own
``TorchCheckpointIO`` (and ``AsyncCheckpointIO``) with a plain ``DataLoader``. This runs the same model,
contenders and timing (its ``WideModel`` and ``TimedCheckpoint``), in the shape issue 28 asks for: the
training data comes from torchdata's ``StatefulDataLoader(shuffle=True, num_workers=2)``, epochs are
longer than the save interval, so most checkpoints are taken in the middle of an epoch, and each holds the
loader's position (its workers' included) and, with ckptd, the ranks' RNG states of the epoch's start. The
stall is the time ``ModelCheckpoint`` spends per checkpoint step; the contenders run interleaved in the
same process, round after round.

Usage: ``python benchmarks/bench_lightning_stall.py [--mib 64] [--steps 30] [--every 5] [--epoch-steps 12]
[--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_lightning import print_table, run_rounds, summarize, timed_fit
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


def run_once(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    checkpoint, wall, _ = timed_fit(name, args, root, lambda width: StatefulDataLoader(
        TensorDataset(torch.randn(args.epoch_steps * 4, width)), batch_size=4, shuffle=True, num_workers=2))
    stalls = sorted(checkpoint.stalls.values())
    inside = sum(1 for step in checkpoint.stalls if step % args.epoch_steps)
    return {"contender": name, "checkpoints": len(stalls), "inside_an_epoch": inside,
            "stall_median_s": statistics.median(stalls), "stall_max_s": stalls[-1], "fit_wall_s": wall,
            "saves_found_busy": checkpoint.busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="fp32 weights in MiB (Adam adds twice that)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--epoch-steps", type=int, default=12, help="batches per epoch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the training compute")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contenders = ("torch", "ckptd")
    results = run_rounds(contenders, args, run_once, "bench-lightning-stall")
    summary = summarize(results, extra=("inside_an_epoch",))
    summary["ckptd_vs_torch_stall"] = summary["ckptd"]["stall_median_s"] / summary["torch"]["stall_median_s"]
    if args.json:
        print(json.dumps({"runs": results, "summary": summary}, indent=1))
        return
    print(f"{summary['ckptd']['checkpoints']} checkpoint steps per run ({summary['ckptd']['inside_an_epoch']} inside "
          f"an epoch), StatefulDataLoader(num_workers=2), medians of {args.rounds} rounds")
    print_table(summary, contenders, args.rounds)
    print(f"ckptd / torch stall: {summary['ckptd_vs_torch_stall']:.2f}x")


if __name__ == "__main__":
    main()
