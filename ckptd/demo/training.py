"""The demo's training job: a small token model with dropout, fed by ckptd's verified shard loader
and checkpointed by ckptd (model, optimizer, loader position and RNG streams).

Run as a child process by :mod:`ckptd.demo.runner`::

    python -m ckptd.demo.training --data MANIFEST --ckpt DIR --steps 60 --crash-at 37 --result OUT.json

With ``--crash-at`` the process sends itself SIGKILL right after that training step, once the saves so
far have reached the object tier (a real crash: no cleanup, no flush, and the steps after it are lost).
Without a checkpoint directory it trains from scratch without saving. It writes
the xxh3-128 digest of its final weights and the last random draws to the result file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch

import ckptd
from ckptd.format.hashing import chunk_digest

VOCAB, EMBED, HIDDEN, CLASSES, BATCH, SEQ_LEN = 256, 32, 64, 4, 16, 16


class TokenModel(torch.nn.Module):
    """Embeds a token sequence, averages it, and classifies it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(EMBED, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, CLASSES),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def to_tensors(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class labels of a batch of token windows (int64, ``[batch, SEQ_LEN]``)."""
    return tokens[:, :-1], tokens[:, -1] % CLASSES


def weights_digest(model: torch.nn.Module) -> str:
    parts = [chunk_digest(t.detach().contiguous().view(torch.uint8).numpy()) for t in model.state_dict().values()]
    return chunk_digest("".join(parts).encode())


def train(data: str, cache: str, ckpt: str | None, steps: int, crash_at: int | None, every: int,
          remote: str | None = None, endpoint_url: str | None = None,
          step_time: float = 0.0) -> dict[str, object]:
    # On the 2-core development VM, the first piece of parallel work a new intra-op worker thread does
    # is sometimes computed imprecisely: `v.sqrt()` on 8192 floats with two threads returned up to
    # 2.8e-4 relative error in the worker's half in 2 of 40 fresh processes, in plain torch without
    # ckptd, and never once the worker had run any parallel op before. In a failing demo that was traced,
    # the resumed run matched the crashed run bit for bit; the uninterrupted run had hit this at its
    # first optimizer step. The demo compares bits, so it keeps all kernels on the training thread;
    # this tiny model gains nothing from threads.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = ckptd.ShardLoader(ckptd.ShardDataset(data, global_batch_size=BATCH, seed=7, cache_dir=cache))
    state: dict[str, object] = {"model": model, "optim": optimizer, "data": loader, "noise_scale": 0.0}
    manager = None
    if ckpt:
        options = {"client_kwargs": {"endpoint_url": endpoint_url}} if endpoint_url else None
        policy = ckptd.Policy(every_steps=every, keep_local=2, remote_every_steps=every, keep_remote=3)
        manager = ckptd.CheckpointManager(ckpt, remote=remote, storage_options=options, policy=policy)
    start = (manager.restore(state) or 0) if manager else 0
    restored_from = manager.last_restore.tier if manager and manager.last_restore else None
    step, losses, seen = start, [], []
    while step < steps:
        for batch in loader:
            step += 1
            inputs, labels = to_tensors(batch)
            seen.append(chunk_digest(inputs.numpy().tobytes()))
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            time.sleep(step_time)  # stands in for the forward/backward time of a real model
            state["noise_scale"] = float(np.random.rand()) + random.random()
            if manager:
                manager.save(step, state)
            if crash_at is not None and step == crash_at:
                if manager:  # the node's disk is lost next: let the saves so far reach the object tier
                    manager.wait_uploads()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == steps:
                break
    if manager:
        manager.close()
    return {"resumed_from": start, "restored_tier": restored_from, "steps": steps, "final_loss": losses[-1] if losses else None,
            "weights_digest": weights_digest(model), "batch_digests": seen,
            "next_random": [torch.rand(1).item(), random.random(), float(np.random.rand())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="dataset manifest (see `ckptd data index`)")
    parser.add_argument("--cache", required=True, help="shard cache directory")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--remote", default=None, help="object tier URL (s3://bucket/prefix)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds each step sleeps")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    result = train(args.data, args.cache, args.ckpt, args.steps, args.crash_at, args.every, args.remote,
                   args.endpoint_url, args.step_time)
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
