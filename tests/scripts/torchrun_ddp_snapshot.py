"""A torchrun-style training script, written the way the DDP tutorials write them (no ckptd import):
``init_process_group`` through ``env://``, DDP, and its own snapshot file that rank 0 saves every few steps
and every rank loads at start.

``python torchrun_ddp_snapshot.py OUT TOTAL EVERY``: trains TOTAL steps; every rank appends
``<pid> <step> <unix time>`` to ``OUT/progress-rank<r>`` after each step; rank 0 writes the final weights
and optimizer state as hex bytes to ``OUT/final.json``.
``STEP_SLEEP`` (seconds) paces each step for the tests, and a file ``OUT/hold-rank<r>-step<s>`` holds rank r
after step s while it exists.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from script_pacing import pace  # the tests' hook (this folder)


def _hex(state: dict) -> dict:
    flat = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            flat[name] = value.numpy().tobytes().hex()
        elif isinstance(value, dict):
            flat.update({f"{name}.{key}": item for key, item in _hex(value).items()})
    return flat


def main() -> None:
    out, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    snapshot_path = os.path.join(out, "snapshot.pt")
    start = 0
    if os.path.exists(snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start = snapshot["step"]
    ddp = DistributedDataParallel(model)
    for step in range(start + 1, total + 1):
        batch = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(4, 8, generator=batch)
        loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with open(os.path.join(out, f"progress-rank{rank}"), "a") as progress:
            progress.write(f"{os.getpid()} {step} {time.time():.6f}\n")
        pace(out, rank, step)
        if rank == 0 and step % every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       snapshot_path + ".tmp")
            os.replace(snapshot_path + ".tmp", snapshot_path)
    if rank == 0:
        final = {"model": _hex(model.state_dict()), "optimizer": _hex(optimizer.state_dict()["state"])}
        with open(os.path.join(out, "final.json"), "w") as written:
            json.dump(final, written, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
