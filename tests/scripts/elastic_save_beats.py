"""A ckptd-aware job whose only heartbeats are its saves (docs/elastic.md's shape), for the hang-blame tests.

``ckptd launch ... elastic_save_beats.py ROOT OUT STEPS [STOP_RANK STOP_STEP]``: every rank trains a small
model on data drawn from (step, rank), averages gradients with all_reduce, saves every step through
``ctx.checkpoint_manager`` into ``ROOT/rank<r>`` (its only heartbeat), and writes its final weights as hex
bytes to ``OUT/rank<r>-final.json`` and its pid per generation joined to ``OUT/rank<r>-pids.txt``. Rank
STOP_RANK sends itself SIGSTOP as it begins step STOP_STEP (after the save of the step before, so it beat
as often as its peers, which then block in the step's all_reduce), in generation 0 only.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import ckptd
import ckptd.elastic


def setup() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def train(ctx: ckptd.elastic.WorkerContext) -> None:
    root, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stop_rank, stop_step = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (-1, -1)
    with open(os.path.join(out, f"rank{ctx.rank}-pids.txt"), "a") as pids:
        pids.write(f"{ctx.generation} {os.getpid()}\n")
    state = ctx.setup
    manager = ctx.checkpoint_manager(os.path.join(root, f"rank{ctx.rank}"), policy=ckptd.Policy(every_steps=1))
    start = manager.restore(state) or 0
    for step in range(start + 1, steps + 1):
        if ctx.rank == stop_rank and step == stop_step and ctx.generation == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
        state["optim"].zero_grad()
        torch.nn.functional.mse_loss(state["model"](x), x.sum(1, keepdim=True)).backward()
        for parameter in state["model"].parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= ctx.world_size
        state["optim"].step()
        manager.save(step, state)
    manager.close()
    weights = {name: value.numpy().tobytes().hex() for name, value in state["model"].state_dict().items()}
    with open(os.path.join(out, f"rank{ctx.rank}-final.json"), "w") as final:
        json.dump(weights, final, sort_keys=True)


if __name__ == "__main__":
    ckptd.elastic.run(train, setup_fn=setup)
