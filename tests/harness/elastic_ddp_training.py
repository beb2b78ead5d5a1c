"""A ckptd-aware DistributedDataParallel job for ``ckptd launch`` tests at any world size:
``ckptd launch --nproc-per-node N ... -m harness.elastic_ddp_training --root ROOT --out OUT``.

Every rank trains a small multi-layer model wrapped in ``DistributedDataParallel`` (built anew in every
generation, as the process group is), on inputs drawn from (step, rank), with AdamW, saving every
``--every`` steps through :meth:`ckptd.elastic.WorkerContext.checkpoint_manager` into ``ROOT/rank<r>``.
By default the DDP is built with ``find_unused_parameters=True``, which keeps its bucket layout from its
first step on (docs/elastic.md, "DistributedDataParallel at three ranks or more"); ``--plain`` builds it
with torch's defaults, whose buckets are laid out again after the first step.

``--kill R:S`` (repeatable): rank R's first process (restart count 0) SIGKILLs itself at step S,
``--kill-phase`` before the step's forward pass (its peers are then in the step's allreduce or about to
enter it) or after that step's save, in either case once its saves so far are committed. Each process
appends ``<generation> <pid> <restart count> <restored step>`` to ``OUT/rank<r>-generations.txt`` once it
restored, and at the end every rank writes its final weights and optimizer state as hex bytes to
``OUT/rank<r>-final.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ckptd
from ckptd import elastic

FEATURES = 12
BATCH_PER_RANK = 4


def _hex(tensor: torch.Tensor) -> str:
    return tensor.detach().contiguous().numpy().tobytes().hex()


def _setup(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    # several tensors in DDP's one bucket: its first step lays them out in definition order, a plain DDP's
    # later steps in the order their gradients are ready (the reverse)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                                torch.nn.Tanh(), torch.nn.Linear(24, 1))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01)}


def _kill_steps(kills: list[str]) -> dict[int, int]:
    steps = {}
    for kill in kills:
        rank, _, step = kill.partition(":")
        steps[int(rank)] = int(step)
    return steps


def _die(manager: ckptd.CheckpointManager) -> None:
    """SIGKILL this process once its saves so far are committed (on every rank: a commit is agreed), so that
    the step the recovery restores does not depend on how fast the writers were."""
    manager.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def _train(ctx: elastic.WorkerContext, args: argparse.Namespace) -> None:
    state = ctx.setup
    model, optim = state["model"], state["optim"]
    ddp = DistributedDataParallel(model) if args.plain else DistributedDataParallel(model, find_unused_parameters=True)
    manager = ctx.checkpoint_manager(Path(args.root) / f"rank{ctx.rank}", policy=ckptd.Policy(every_steps=args.every))
    start = manager.restore(state) or 0
    out = Path(args.out)
    with (out / f"rank{ctx.rank}-generations.txt").open("a") as joined:
        joined.write(f"{ctx.generation} {os.getpid()} {ctx.restart_count} {start}\n")
    dies_at = _kill_steps(args.kill).get(ctx.rank) if ctx.restart_count == 0 else None
    for step in range(start + 1, args.steps + 1):
        if step == dies_at and args.kill_phase == "before-step":
            _die(manager)
        inputs = torch.randn(BATCH_PER_RANK, FEATURES, generator=torch.Generator().manual_seed(step * 1000 + ctx.rank))
        optim.zero_grad()
        F.mse_loss(ddp(inputs), inputs.sum(dim=1, keepdim=True).sin()).backward()
        optim.step()
        manager.save(step, state)
        if step == dies_at and args.kill_phase == "after-save":
            _die(manager)
    manager.close()
    optimizer_state = {f"{index}.{name}": _hex(value) if isinstance(value, torch.Tensor) else repr(value)
                       for index, entry in optim.state_dict()["state"].items() for name, value in entry.items()}
    final = {"weights": {name: _hex(value) for name, value in model.state_dict().items()},
             "optimizer": optimizer_state}
    (out / f"rank{ctx.rank}-final.json").write_text(json.dumps(final, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="DistributedDataParallel with torch's defaults")
    parser.add_argument("--kill", action="append", default=[], metavar="RANK:STEP")
    parser.add_argument("--kill-phase", choices=("before-step", "after-save"), default="before-step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    elastic.run(lambda ctx: _train(ctx, args), setup_fn=lambda: _setup(args.seed))


if __name__ == "__main__":
    main()
