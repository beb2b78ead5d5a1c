"""The demo's training job: a small MLP with dropout on synthetic data, checkpointed by ckptd.

Run as a child process by :mod:`ckptd.demo.runner`::

    python -m ckptd.demo.training --ckpt DIR --steps 60 --crash-at 37 --result OUT.json

With ``--crash-at`` the process sends itself SIGKILL right after that training step (a real crash:
no cleanup, no flush). Without a checkpoint directory it trains from scratch without saving. It writes
the xxh3-128 digest of its final weights and the last random draws to the result file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch

import ckptd
from ckptd.format.hashing import chunk_digest

INPUT_SIZE, HIDDEN, CLASSES, BATCH = 32, 64, 4, 16


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(INPUT_SIZE, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def synthetic_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a fixed synthetic data set (a pure function of the step)."""
    generator = torch.Generator().manual_seed(10_000 + step)
    inputs = torch.randn(BATCH, INPUT_SIZE, generator=generator)
    labels = (inputs[:, :CLASSES].argmax(dim=1) + step) % CLASSES
    return inputs, labels


def weights_digest(model: torch.nn.Module) -> str:
    parts = [chunk_digest(t.detach().contiguous().view(torch.uint8).numpy()) for t in model.state_dict().values()]
    return chunk_digest("".join(parts).encode())


def train(ckpt: str | None, steps: int, crash_at: int | None, every: int) -> dict[str, object]:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, object] = {"model": model, "optim": optimizer, "noise_scale": 0.0}
    manager = ckptd.CheckpointManager(ckpt, policy=ckptd.Policy(every_steps=every, keep_local=2)) if ckpt else None
    start = (manager.restore(state) or 0) if manager else 0
    losses = []
    for step in range(start + 1, steps + 1):
        inputs, labels = synthetic_batch(step)
        inputs = inputs + float(np.random.normal()) * 0.01 + random.random() * 0.01
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        state["noise_scale"] = float(np.random.rand())
        if manager:
            manager.save(step, state)
        if crash_at is not None and step == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if manager:
        manager.close()
    return {"resumed_from": start, "steps": steps, "final_loss": losses[-1] if losses else None,
            "weights_digest": weights_digest(model), "next_random": [torch.rand(1).item(), random.random(),
                                                                     float(np.random.rand())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    result = train(args.ckpt, args.steps, args.crash_at, args.every)
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
