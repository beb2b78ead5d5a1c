"""The soak run's training job (``benchmarks/soak.py``): ``ckptd launch ... -m harness.soak_job``.

A small data-parallel MLP on gloo, fed by ckptd's verified shard loader (JSON-lines shards whose samples
carry their shard and index; each rank takes its slice of every global batch), gradients averaged with
``all_reduce``, checkpointed every ``--every`` steps through :meth:`ckptd.elastic.WorkerContext.
checkpoint_manager` into ``<root>/rank<r>`` (with ``--remote`` as the object tier and the node's daemon
found as usual: ``--daemon auto``). The sample-id stream is part of the state as a chained xxh3-128
digest (``stream``: the digest of the previous digest, the step and the step's sample ids), so a recovery
that skipped, repeated or reordered a sample changes the final digest.

The job runs to ``--steps`` or, with ``--stop-file``, to the step number that file holds once it exists
(read before every step; the driver writes a step every rank has not reached yet). Records in ``--out``,
``K`` being ``--incarnation`` (the driver's count of job starts):

- ``rank<r>-inc<K>-gen<g>.json``: pid, generation, restored step and tier, wall-clock times of entering
  the generation, of the restore and of the first completed step;
- ``rank<r>-progress.log``: one line per completed step, ``<time> <K> <generation> <step> <stream digest>``
  (a step replayed after a rollback appears again; its digest must be the same);
- ``rank<r>-final.json``: weights and optimizer state (hex of the raw bytes), the stream digest, the loader
  state and the last step, written after ``close``.

SIGUSR1 makes a rank print the stacks of all its threads to stderr (the supervisor's log).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckptd
from ckptd import elastic
from ckptd.data.collate import list_batch
from ckptd.format.hashing import chunk_digest

#: Samples per shard of the soak dataset (:func:`write_dataset`), and samples per rank per step.
SHARD_SIZES = (48, 48, 48, 48)
BATCH_PER_RANK = 4
FEATURES = 16


def write_dataset(directory: Path) -> Path:
    """Write the soak job's JSON-lines shards under ``directory/shards`` and their manifest; returns the
    manifest's path (the ``--data`` of the job)."""
    from ckptd.data import index_dataset, save_dataset_manifest
    from ckptd.data.testing import write_jsonl_shards

    write_jsonl_shards(directory / "shards", SHARD_SIZES)
    manifest = directory / "manifest.json"
    save_dataset_manifest(index_dataset(str(directory / "shards"), "jsonl").manifest, manifest)
    return manifest


def _hex(tensor: torch.Tensor) -> str:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


def _next_digest(digest: torch.Tensor, step: int, ids: list[str]) -> None:
    """Chain ``step`` and its sample ids into ``digest`` (16 bytes, in place)."""
    chained = chunk_digest(digest.numpy().tobytes() + f"{step}:{','.join(ids)}".encode())
    digest.copy_(torch.frombuffer(bytearray.fromhex(chained), dtype=torch.uint8))


def _stop_at(args: argparse.Namespace) -> int:
    if args.stop_file:
        try:
            return int(Path(args.stop_file).read_text().strip())
        except (OSError, ValueError):
            pass
    return args.steps


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    total = sum(SHARD_SIZES)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01),
            "features": torch.randn(total, FEATURES, generator=torch.Generator().manual_seed(args.seed))}


def _train(ctx: elastic.WorkerContext, args: argparse.Namespace) -> None:
    entered = time.time()
    model, optim, features = ctx.setup["model"], ctx.setup["optim"], ctx.setup["features"]
    dataset = ckptd.ShardDataset(args.data, global_batch_size=BATCH_PER_RANK * ctx.world_size, seed=args.seed,
                                 cache_dir=Path(args.cache) / f"rank{ctx.rank}", rank=ctx.rank,
                                 world_size=ctx.world_size, collate_fn=list_batch)
    loader = ckptd.ShardLoader(dataset, with_sample_ids=True)
    stream = torch.zeros(16, dtype=torch.uint8)
    state: dict[str, Any] = {"model": model, "optim": optim, "data": loader, "stream": stream}
    options: dict[str, Any] = {"daemon": args.daemon}
    if args.remote:
        options.update(remote=args.remote, storage_options={"client_kwargs": {"endpoint_url": args.endpoint_url}})
    manager = ctx.checkpoint_manager(Path(args.root) / f"rank{ctx.rank}",
                                     policy=ckptd.Policy(every_steps=args.every, keep_local=3), **options)
    start = manager.restore(state) or 0
    out = Path(args.out)
    record: dict[str, Any] = {"pid": os.getpid(), "incarnation": args.incarnation, "generation": ctx.generation,
                              "restored": start or None, "daemon_promotes": manager.daemon_promotes,
                              "tier": manager.last_restore.tier if manager.last_restore else None,
                              "entered_at": entered, "restored_at": time.time()}
    record_path = out / f"rank{ctx.rank}-inc{args.incarnation}-gen{ctx.generation}.json"
    record_path.write_text(json.dumps(record))
    offsets = [sum(SHARD_SIZES[:shard]) for shard in range(len(SHARD_SIZES))]
    step, batches = start, iter(loader)
    with open(out / f"rank{ctx.rank}-progress.log", "a", encoding="utf-8") as progress:
        while step < _stop_at(args):
            try:
                samples, ids = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                continue
            step += 1
            _next_digest(stream, step, ids)
            inputs = features[[offsets[sample["shard"]] + sample["index"] for sample in samples]]
            optim.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True).sin()).backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= ctx.world_size
            optim.step()
            if args.step_time:
                time.sleep(args.step_time)  # stands in for the compute of a real model
            manager.save(step, state)
            progress.write(f"{time.time():.6f} {args.incarnation} {ctx.generation} {step} {_hex(stream)}\n")
            progress.flush()
            if step == start + 1:
                record_path.write_text(json.dumps(record | {"first_step_at": time.time()}))
    manager.close()
    optimizer_state = {f"{index}.{name}": _hex(value) if isinstance(value, torch.Tensor) else repr(value)
                       for index, entry in optim.state_dict()["state"].items() for name, value in entry.items()}
    final = {"step": step, "weights": {name: _hex(value) for name, value in model.state_dict().items()},
             "optimizer": optimizer_state, "stream": _hex(stream), "data": loader.state_dict()}
    (out / f"rank{ctx.rank}-final.json").write_text(json.dumps(final, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="local checkpoint directory (one per rank under it)")
    parser.add_argument("--out", required=True, help="where the ranks write their records")
    parser.add_argument("--data", required=True, help="dataset manifest (write_dataset)")
    parser.add_argument("--cache", required=True, help="shard cache directory (one per rank under it)")
    parser.add_argument("--steps", type=int, default=2**62, help="last step, unless --stop-file names one")
    parser.add_argument("--stop-file", default=None, help="a file that, once it exists, holds the last step")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps")
    parser.add_argument("--remote", default=None, help="object tier URL")
    parser.add_argument("--endpoint-url", default=None, help="S3 endpoint of --remote")
    parser.add_argument("--daemon", choices=("auto", "off", "require"), default="auto")
    parser.add_argument("--incarnation", type=int, default=0, help="the driver's count of job starts")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's look at a rank that hangs
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    elastic.run(lambda ctx: _train(ctx, args), setup_fn=lambda: _setup(args))


if __name__ == "__main__":
    main()
