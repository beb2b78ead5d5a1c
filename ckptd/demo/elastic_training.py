"""The demo's data-parallel job under ``ckptd launch``: the demo's token model on 2 gloo ranks, each fed its
slice of every global batch by ckptd's verified shard loader, gradients averaged with ``all_reduce``, and
checkpointed through :meth:`ckptd.elastic.WorkerContext.checkpoint_manager` (model, optimizer, loader
position, RNG streams, and the digests of the batches seen so far). Model and optimizer are built by the
``setup_fn`` (:func:`ckptd.elastic.run`), so that a warm spare has them ready.

Run by :mod:`ckptd.demo.elastic_phase`::

    ckptd launch --nproc-per-node 2 [--spares 1] -m ckptd.demo.elastic_training --data MANIFEST --cache DIR --ckpt DIR \\
        --out DIR [--kill-rank R --kill-step S]

With ``--kill-rank`` rank R sends itself SIGKILL right after its save of step S in the first generation, once
its saves so far are committed.
Every rank writes ``rank<r>-gen<g>.json`` for every generation it joins (pid, restored step and tier,
wall-clock times of joining, of the restore and of its first completed step), the victim
``rank<r>-killed.json`` just before the signal, and at the end ``rank<r>-final.json`` (xxh3-128 of the
weights and of the optimizer state, the batch digests of every step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ckptd
from ckptd import elastic
from ckptd.demo.training import BATCH, TokenModel, to_tensors, weights_digest
from ckptd.format.hashing import chunk_digest


def _tensor_digest(tensor: torch.Tensor) -> str:
    return chunk_digest(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    parts = [_tensor_digest(value) if isinstance(value, torch.Tensor) else repr(value)
             for entry in optimizer.state_dict()["state"].values() for value in entry.values()]
    return chunk_digest("".join(parts).encode())


def _batch_id(inputs: torch.Tensor) -> int:
    """The first 63 bits of the batch's xxh3 digest (fits a checkpointed int64 tensor)."""
    return int(chunk_digest(inputs.numpy().tobytes())[:16], 16) >> 1


def _setup() -> dict[str, Any]:
    """What does not depend on the rank (a warm spare builds it before it is given one)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TokenModel()
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def _train(ctx: elastic.WorkerContext, args: argparse.Namespace) -> None:
    entered = time.time()
    model, optimizer = ctx.setup["model"], ctx.setup["optim"]
    torch.manual_seed(1 + ctx.rank)  # each rank its own dropout stream
    np.random.seed(ctx.rank)
    random.seed(ctx.rank)
    dataset = ckptd.ShardDataset(args.data, global_batch_size=BATCH * ctx.world_size, seed=7, cache_dir=args.cache,
                                 rank=ctx.rank, world_size=ctx.world_size)
    loader = ckptd.ShardLoader(dataset)
    seen = torch.full((args.steps,), -1, dtype=torch.int64)
    state: dict[str, Any] = {"model": model, "optim": optimizer, "data": loader, "seen": seen}
    manager = ctx.checkpoint_manager(Path(args.ckpt) / f"rank{ctx.rank}",
                                     policy=ckptd.Policy(every_steps=args.every, keep_local=3))
    start = manager.restore(state) or 0
    out = Path(args.out)
    record: dict[str, Any] = {"pid": os.getpid(), "generation": ctx.generation, "restored": start or None,
                              "tier": manager.last_restore.tier if manager.last_restore else None,
                              "entered_at": entered, "restored_at": time.time()}
    record_path = out / f"rank{ctx.rank}-gen{ctx.generation}.json"
    record_path.write_text(json.dumps(record))
    step = start
    batches = iter(loader)
    while step < args.steps:
        try:
            batch = next(batches)
        except StopIteration:  # the next epoch
            batches = iter(loader)
            continue
        step += 1
        inputs, labels = to_tensors(batch)
        seen[step - 1] = _batch_id(inputs)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad /= ctx.world_size
        optimizer.step()
        time.sleep(args.step_time)  # stands in for the forward/backward time of a real model
        manager.save(step, state)
        if step == start + 1:
            record_path.write_text(json.dumps(record | {"first_step_at": time.time()}))
        if ctx.generation == 0 and ctx.rank == args.kill_rank and step == args.kill_step:
            manager.wait()  # its saves so far are committed: the steps lost are those after the last save
            (out / f"rank{ctx.rank}-killed.json").write_text(json.dumps({"step": step, "at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    final = {"weights": weights_digest(model), "optimizer": _optimizer_digest(optimizer), "seen": seen.tolist()}
    (out / f"rank{ctx.rank}-final.json").write_text(json.dumps(final))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="dataset manifest (see `ckptd data index`)")
    parser.add_argument("--cache", required=True, help="shard cache directory")
    parser.add_argument("--ckpt", required=True, help="local checkpoint directory (one per rank under it)")
    parser.add_argument("--out", required=True, help="where the ranks write their records")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds each step sleeps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # see ckptd.demo.training.train: the demo compares bits
    Path(args.out).mkdir(parents=True, exist_ok=True)
    elastic.run(lambda ctx: _train(ctx, args), setup_fn=_setup)


if __name__ == "__main__":
    main()
