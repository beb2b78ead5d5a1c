"""Save stall per checkpoint under Lightning: ckptd's CheckpointIO against Lightning's own (not a test).

One tiny-compute, large-state run (an MLP of ``--mib`` MiB of fp32 weights, Adam: the checkpoint is
about three times that) trains ``--steps`` steps on CPU and saves a checkpoint every ``--every`` steps
through ``ModelCheckpoint(save_top_k=1, save_last=True)``, once per contender, rounds interleaved:

- ``torch``: Lightning's default ``TorchCheckpointIO`` (``torch.save`` on the training thread);
- ``async``: Lightning's ``AsyncCheckpointIO`` (clones the tensors, then ``torch.save`` on a thread);
- ``ckptd``: ``CkptdCheckpointIO`` (stages into reusable host buffers; hashing, writing, the commit run
  on ckptd's writer thread).

The stall is the time ``ModelCheckpoint`` spends per checkpoint file (``trainer.save_checkpoint``: dumping
Lightning's state and the CheckpointIO call), which is what the training loop waits for (for ckptd it
includes waiting for the previous save when it is still being written: ``saves_found_busy`` counts them;
``AsyncCheckpointIO`` queues its clones instead, holding one more copy of the state per queued save); ``save_last``
makes two files per checkpoint step, and the stall is counted per step (both files). Also reported: the
fit's wall time, which includes the wait for pending writes in ``teardown``.

Usage: ``python benchmarks/bench_lightning.py [--mib 64] [--steps 30] [--every 5] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from ckptd.plugins.lightning import CkptdCheckpointIO


class WideModel(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_index):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that records the time of each ``trainer.save_checkpoint`` it makes, by global step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stalls: dict[int, float] = {}
        self.busy = 0  # ckptd only: saves that found the previous one still being written (they wait for it)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, CkptdCheckpointIO) and trainer.global_step not in self.stalls and io.manager.busy:
            self.busy += 1
        started = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.stalls[trainer.global_step] = self.stalls.get(trainer.global_step, 0.0) + time.perf_counter() - started


def _io(name: str, root: Path) -> Any:
    if name == "torch":
        return TorchCheckpointIO()
    if name == "async":
        return AsyncCheckpointIO()
    return CkptdCheckpointIO(root / "ckptd", daemon="off")


def timed_fit(name: str, args: argparse.Namespace, root: Path,
              make_data: Callable[[int], Any]) -> tuple[TimedCheckpoint, float, WideModel]:
    """One ``fit`` of a WideModel of ``args.mib`` MiB through contender ``name``'s CheckpointIO, on the loader
    ``make_data(width)`` makes (after the seed is set); its timed checkpoints, its wall time and the model."""
    width = 1024
    layers = max(1, int(args.mib * 2**20 / (4 * (width * width + width))))
    L.seed_everything(0)
    data = make_data(width)
    checkpoint = TimedCheckpoint(dirpath=root / "lightning", every_n_train_steps=args.every, save_top_k=1,
                                 save_last=True)
    trainer = L.Trainer(max_steps=args.steps, plugins=[_io(name, root)], callbacks=[checkpoint], logger=False,
                        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(root))
    model = WideModel(width, layers)
    started = time.perf_counter()
    trainer.fit(model, train_dataloaders=data)
    return checkpoint, time.perf_counter() - started, model


def run_once(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    checkpoint, wall, model = timed_fit(name, args, root, lambda width: DataLoader(
        TensorDataset(torch.randn(args.steps * 4, width)), batch_size=4))
    stalls = sorted(checkpoint.stalls.values())
    return {"contender": name, "checkpoints": len(stalls), "stalls_s": [checkpoint.stalls[s] for s in sorted(checkpoint.stalls)],
            "stall_median_s": statistics.median(stalls), "saves_found_busy": checkpoint.busy,
            "stall_max_s": stalls[-1], "fit_wall_s": wall,
            "state_mib": sum(p.numel() for p in model.parameters()) * 4 * 3 / 2**20}


def run_rounds(contenders: tuple[str, ...], args: argparse.Namespace,
               run_once: Callable[[str, argparse.Namespace, Path], dict[str, Any]],
               prefix: str) -> dict[str, list[dict[str, Any]]]:
    """``args.rounds`` rounds, each running every contender once in a fresh directory, in the same order."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name in contenders:
            root = Path(tempfile.mkdtemp(prefix=f"{prefix}-{name}-"))
            try:
                results[name].append(run_once(name, args, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return results


def summarize(results: dict[str, list[dict[str, Any]]], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per contender: the median stall and fit time over the rounds, the worst stall, the saves that waited,
    and the first round's value of each key in ``extra``."""
    return {name: {"stall_median_s": statistics.median(r["stall_median_s"] for r in runs),
                   "stall_max_s": max(r["stall_max_s"] for r in runs),
                   "fit_wall_s": statistics.median(r["fit_wall_s"] for r in runs),
                   "checkpoints": runs[0]["checkpoints"], **{key: runs[0][key] for key in extra},
                   "saves_found_busy": sum(r["saves_found_busy"] for r in runs)}
            for name, runs in results.items()}


def print_table(summary: dict[str, Any], contenders: tuple[str, ...], rounds: int) -> None:
    """The stall table and how many of ckptd's saves waited for the previous one."""
    print(f"{'contender':<10} {'stall/ckpt (s)':>15} {'max (s)':>9} {'fit wall (s)':>13}")
    for name in contenders:
        row = summary[name]
        print(f"{name:<10} {row['stall_median_s']:>15.3f} {row['stall_max_s']:>9.3f} {row['fit_wall_s']:>13.2f}")
    print(f"ckptd saves that waited for the previous one: {summary['ckptd']['saves_found_busy']} of "
          f"{summary['ckptd']['checkpoints'] * rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="fp32 weights in MiB (Adam adds twice that)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the training compute")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contenders = ("torch", "async", "ckptd")
    results = run_rounds(contenders, args, run_once, "bench-lightning")
    summary = summarize(results, extra=("state_mib",))
    for name in ("torch", "async"):
        summary[f"ckptd_vs_{name}_stall"] = summary["ckptd"]["stall_median_s"] / summary[name]["stall_median_s"]
    if args.json:
        print(json.dumps({"runs": results, "summary": summary}, indent=1))
        return
    print(f"state {summary['ckptd']['state_mib']:.0f} MiB (weights + Adam), {summary['ckptd']['checkpoints']} "
          f"checkpoint steps per run, medians of {args.rounds} rounds")
    print_table(summary, contenders, args.rounds)
    print(f"ckptd / torch stall: {summary['ckptd_vs_torch_stall']:.2f}x; "
          f"ckptd / async stall: {summary['ckptd_vs_async_stall']:.2f}x")


if __name__ == "__main__":
    main()
