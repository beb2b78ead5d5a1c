"""Save stall of ``accelerate``'s ``save_state``: accelerate alone, through CkptdAccelerate, and ``hooks.save()``
(not a test).

One process, one model (an MLP, AdamW: weights plus two moment tensors per weight, a few tens of MB), one
accelerator. Each round, with ``--train-steps`` training steps before every save: ``--saves`` of accelerate's own
``save_state`` (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, the RNG pickle, written
synchronously), then a :class:`ckptd.plugins.huggingface.CkptdAccelerate` on a fresh local directory (its
first save, which allocates the staging buffers, is not timed) and ``--saves`` pairs of
``accelerator.save_state`` through it (the state is staged into host memory, only ``ckptd-step.json`` is
written; ckptd writes and commits in the background) and ``hooks.save()`` (the same staging, no directory),
alternating (each goes first in every other pair). The stall is the time the training thread spends in the
call (a save that finds the previous one still being written waits for it: give the training enough steps
between saves); the bytes are what the call left in its output directory. The round's last commit is waited
for outside the timing.

Usage: ``python benchmarks/bench_accelerate_stall.py [--width 1024] [--layers 3] [--saves 6] [--train-steps 40]
[--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("accelerate", "ckptd_save_state", "hooks_save")


def _bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def measure(options: argparse.Namespace) -> dict[str, Any]:
    """Stalls and bytes per save of each mode, ``options.rounds`` rounds of ``options.saves`` saves each."""
    import torch
    from accelerate import Accelerator

    from ckptd.plugins.huggingface import CkptdAccelerate

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    layers: list[torch.nn.Module] = []
    for _ in range(options.layers):
        layers += [torch.nn.Linear(options.width, options.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=10**6)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    inputs = torch.randn(options.batch, options.width)

    def train() -> None:
        for _ in range(options.train_steps):
            accelerator.backward(model(inputs).square().mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    written: dict[str, list[int]] = {mode: [] for mode in MODES}
    root = Path(tempfile.mkdtemp(prefix="ckptd-bench-accelerate-"))
    step = 0

    def timed_save(mode: str, hooks: Any) -> None:
        nonlocal step
        train()
        step += 1
        out = root / "out" / f"{mode}-{step}"
        start = time.perf_counter()
        if mode == "hooks_save":
            hooks.save(step)
        else:
            accelerator.save_state(str(out))
        stalls[mode].append(time.perf_counter() - start)
        written[mode].append(_bytes(out) if out.exists() else 0)
        shutil.rmtree(out, ignore_errors=True)

    try:
        for round_number in range(options.rounds):
            for _ in range(options.saves):
                timed_save("accelerate", None)
            hooks = CkptdAccelerate(accelerator, root / f"ckpt-{round_number}", step=lambda: step)
            hooks.save(0)  # the first save allocates the staging buffers: not timed
            for pair in range(options.saves):  # alternating on the same manager, each first every other time
                for mode in ("ckptd_save_state", "hooks_save")[::1 if pair % 2 == 0 else -1]:
                    timed_save(mode, hooks)
            hooks.close()  # waits for the last commit (not timed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values()) + sum(
        value.numel() * value.element_size() for values in optimizer.state_dict()["state"].values()
        for value in values.values() if isinstance(value, torch.Tensor))
    report: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()), "state_bytes": state_bytes,
                              "saves_per_mode": options.saves * options.rounds}
    for mode in MODES:
        report[mode] = {"stall_median_s": statistics.median(stalls[mode]), "stall_max_s": max(stalls[mode]),
                        "stall_first_s": stalls[mode][0], "written_bytes_median": statistics.median(written[mode])}
    accelerate_alone = report["accelerate"]["stall_median_s"]
    report["ratio_accelerate_over_ckptd_save_state"] = accelerate_alone / report["ckptd_save_state"]["stall_median_s"]
    report["ratio_accelerate_over_hooks_save"] = accelerate_alone / report["hooks_save"]["stall_median_s"]
    report["ratio_ckptd_save_state_over_hooks_save"] = (report["ckptd_save_state"]["stall_median_s"]
                                                        / report["hooks_save"]["stall_median_s"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    options = parser.parse_args()
    report = measure(options)
    if options.json:
        print(json.dumps(report, indent=2))
        return
    print(f"MLP, {report['parameters'] / 1e6:.1f} M parameters, AdamW: {report['state_bytes'] / 1e6:.0f} MB of "
          f"state; {report['saves_per_mode']} saves per mode")
    print(f"{'':18} {'stall median':>13} {'first':>8} {'max':>8} {'bytes in the directory':>24}")
    for mode in MODES:
        row = report[mode]
        print(f"{mode:18} {row['stall_median_s']:>12.4f}s {row['stall_first_s']:>7.3f}s {row['stall_max_s']:>7.3f}s "
              f"{row['written_bytes_median']:>24,.0f}")
    print(f"accelerate alone / save_state through ckptd: {report['ratio_accelerate_over_ckptd_save_state']:.1f}x; "
          f"accelerate alone / hooks.save(): {report['ratio_accelerate_over_hooks_save']:.1f}x; "
          f"save_state through ckptd / hooks.save(): {report['ratio_ckptd_save_state_over_hooks_save']:.2f}")


if __name__ == "__main__":
    main()
