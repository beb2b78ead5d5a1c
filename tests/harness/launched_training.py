"""A small data-parallel training job for launcher tests: ``torchrun ... -m harness.launched_training``.

Every rank trains the same model on its own deterministic batches, averages gradients with gloo, and
checkpoints through a :class:`~ckptd.CheckpointManager` into its own directory (``<root>/node<rank>``).
With ``--kill-rank R --kill-after S`` rank R sends itself SIGKILL after step S of the launcher's first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0), once its newest save is committed; the launcher then restarts
the job, which restores and trains to the end. Each rank writes, per attempt, the step it restored, and at
the end its final weights, into ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ckptd


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    inputs = torch.randn(32, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-after", type=int, default=-1)
    args = parser.parse_args(argv)

    faulthandler.dump_traceback_later(90, exit=True)  # a hang becomes a failed attempt with every stack
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The launcher's store outlives restart attempts. gloo's own rendezvous keys in it are not scoped to
    # the attempt (torch 2.13 then connects to a dead peer's address), so the process group gets a store
    # prefixed with the attempt; ckptd is handed the unprefixed store, where it scopes its own keys.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = ckptd.CheckpointManager(Path(args.root) / f"node{rank}",
                                      policy=ckptd.Policy(every_steps=args.every, keep_local=2), store=store)
    state = {"model": model, "optim": optim}
    start = manager.restore(state)
    (out / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps({"restored": start, "generation": getattr(manager.coordinator, "generation", 0)}))
    for step in range((start or 0) + 1, args.steps + 1):
        inputs, targets = _batch(step, rank)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
        optim.step()
        manager.save(step, state)
        if attempt == 0 and rank == args.kill_rank and step == args.kill_after:
            manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    weights = {name: value.detach().numpy().tobytes().hex() for name, value in model.state_dict().items()}
    (out / f"rank{rank}-final.json").write_text(json.dumps(weights))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
