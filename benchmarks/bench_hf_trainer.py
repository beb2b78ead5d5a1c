"""Save stall of ``transformers.Trainer`` checkpoints: ckptd's callback against the Trainer's own (not a test).

The same run three times, in this order each round: no checkpoints, the Trainer's default checkpointing
(``save_strategy="steps"``: ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, RNG and trainer
state in ``checkpoint-N``), and :class:`ckptd.plugins.huggingface.CkptdCallback` on a local directory (the
callback takes the same save requests; writing, hashing and the commit run in the background). A GPT-2
built from a config (no download), AdamW.

Reported per checkpoint:

- ``stall``: seconds the training thread spends in the save, measured around the Trainer's
  ``_save_checkpoint`` and around the callback's save (staging into host memory);
- ``added wall``: (wall time from the start of the training to the end of its last step - the same for the
  run without checkpoints) / the checkpoints before the last step, which also counts what the background
  writer takes from the training on a small machine. The last checkpoint (the Trainer's write, or ckptd's
  wait for its commit when the training ends) is left out of it and reported as ``final``.

Usage: ``python benchmarks/bench_hf_trainer.py [--steps 16] [--save-every 4] [--n-embd 512] [--n-layer 6]
[--rounds 1] [--json]``.
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


def _run(mode: str, root: Path, options: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from ckptd.plugins.huggingface import CkptdCallback, ckptd_resume

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return options.steps * options.batch

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(options.seq_len, dtype=torch.long).add_(index).remainder_(options.vocab)
            return {"input_ids": ids, "labels": ids.clone()}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=options.vocab, n_positions=options.seq_len,
                                       n_embd=options.n_embd, n_layer=options.n_layer, n_head=8))
    callback = CkptdCallback(root / "ckpt", policy=None) if mode == "ckptd" else None
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=options.steps,
                             per_device_train_batch_size=options.batch, save_strategy="no" if mode == "none" else
                             "steps", save_steps=options.save_every, save_total_limit=2, logging_steps=10**6,
                             report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    last_step: list[float] = []

    class LastStep(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == options.steps:
                last_step.append(time.perf_counter())

    callbacks: list[Any] = [LastStep()] + ([callback] if callback else [])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its log lines would mix with --json
    stalls: list[float] = []

    def timed(function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                stalls.append(time.perf_counter() - start)
        return wrapper

    if mode == "trainer":
        trainer._save_checkpoint = timed(trainer._save_checkpoint)
    if callback is not None:
        callback._save = timed(callback._save)
        ckptd_resume(trainer)  # a fresh directory: nothing to resume
    start = time.perf_counter()
    trainer.train()  # the callback waits for its last commit at the end of the training
    wall = time.perf_counter() - start
    if callback is not None:
        callback.close()
    parameters = sum(p.numel() for p in model.parameters())
    return {"mode": mode, "wall_s": wall, "steps_wall_s": last_step[0] - start, "stalls_s": stalls,
            "parameters": parameters}


def measure(options: argparse.Namespace) -> dict[str, Any]:
    """Each mode ``options.rounds`` times, alternating; medians per mode."""
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "trainer": [], "ckptd": []}
    for _ in range(options.rounds):
        for mode in runs:
            root = Path(tempfile.mkdtemp(prefix=f"ckptd-bench-hf-{mode}-"))
            try:
                runs[mode].append(_run(mode, root, options))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    saves = options.steps // options.save_every
    baseline = statistics.median(run["steps_wall_s"] for run in runs["none"])
    baseline_wall = statistics.median(run["wall_s"] for run in runs["none"])
    report: dict[str, Any] = {"parameters": runs["none"][0]["parameters"], "steps": options.steps,
                              "checkpoints": saves, "wall_without_checkpoints_s": baseline}
    for mode in ("trainer", "ckptd"):
        stalls = [stall for run in runs[mode] for stall in run["stalls_s"]]
        steps_wall = statistics.median(run["steps_wall_s"] for run in runs[mode])
        wall = statistics.median(run["wall_s"] for run in runs[mode])
        report[mode] = {"stall_median_s": statistics.median(stalls), "stall_max_s": max(stalls),
                        "added_wall_per_checkpoint_s": (steps_wall - baseline) / max(saves - 1, 1),
                        "final_s": (wall - steps_wall) - (baseline_wall - baseline), "wall_s": wall}
    report["stall_ratio_trainer_over_ckptd"] = report["trainer"]["stall_median_s"] / report["ckptd"]["stall_median_s"]
    trainer_added, ckptd_added = (report[mode]["added_wall_per_checkpoint_s"] for mode in ("trainer", "ckptd"))
    # None when the machine's noise exceeds what the checkpoints add (a busy machine: run more --rounds)
    report["added_wall_ratio_trainer_over_ckptd"] = trainer_added / ckptd_added if min(trainer_added,
                                                                                       ckptd_added) > 0 else None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    options = parser.parse_args()
    report = measure(options)
    if options.json:
        print(json.dumps(report, indent=2))
        return
    print(f"GPT-2, {report['parameters'] / 1e6:.1f} M parameters, {report['steps']} steps, "
          f"{report['checkpoints']} checkpoints; training without checkpoints: "
          f"{report['wall_without_checkpoints_s']:.2f} s")
    print(f"{'':10} {'stall median':>13} {'stall max':>10} {'added wall / ckpt':>18} {'final':>7}")
    for mode in ("trainer", "ckptd"):
        row = report[mode]
        print(f"{mode:10} {row['stall_median_s']:>12.3f}s {row['stall_max_s']:>9.3f}s "
              f"{row['added_wall_per_checkpoint_s']:>17.3f}s {row['final_s']:>6.2f}s")
    added = report["added_wall_ratio_trainer_over_ckptd"]
    print(f"stall ratio (Trainer / ckptd): {report['stall_ratio_trainer_over_ckptd']:.1f}x; added wall ratio: "
          + ("below the machine's noise" if added is None else f"{added:.1f}x"))


if __name__ == "__main__":
    main()
