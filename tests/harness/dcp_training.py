"""A torchtitan-like training loop that checkpoints with plain DCP and ckptd's storage plugins.

One rank per process (started by :func:`launch_ranks`, or by hand with ``RANK``/``WORLD_SIZE``/
``MASTER_PORT`` set): an FSDP2 (``fully_shard``) model and its Adam state on a CPU gloo mesh, wrapped in
a ``Stateful`` app state as DCP's recipes do, plus a train state (step, an ``io.BytesIO`` as PyTorch's
training-state examples hold). Every ``--save-every`` steps it saves with ``dcp.save`` or
``dcp.async_save`` (``--save-mode``) through one reused :class:`~ckptd.dcp.CkptdStorageWriter`: to
``checkpoint_id=<root>/step-<12 digits>`` of the training step (``--ids step``), or to the root itself,
each save then writing the root's next step (``--ids auto``). With ``--kill-after N`` every rank, once
the save of step ``N`` is committed, says so with a file ``committed-<rank>`` in ``--ready-dir`` and
waits: :func:`launch_ranks` then SIGKILLs every rank (a crash from outside, as a node failure is). At start it resumes from the newest committed step with
``dcp.load`` and :class:`~ckptd.dcp.CkptdStorageReader`. At the end rank 0 writes the full weights (hex
of their bytes) to ``--out``; with ``--check-saves`` every rank first loads back each save of this run
(found through the ``storage_meta`` of the metadata the save returned) and compares it with what it
held when it saved, byte for byte.

Run: ``python -m harness.dcp_training --root DIR --steps 8 --save-every 2 --out weights.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.format.layout import step_dir
from ckptd.tiers import open_tier


def build_model() -> nn.Module:
    """The unsharded model every run starts from (same seed, same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def sharded(model: nn.Module, world_size: int) -> nn.Module:
    """``model`` with every linear layer and the root under FSDP2 on a CPU mesh."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class AppState(Stateful):
    """Model and optimizer as one DCP ``Stateful`` (DCP's recipe): sharded state dicts via
    ``get_state_dict``/``set_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def _local_bytes(tree: Any, prefix: str = "") -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.update(_local_bytes(value, f"{prefix}/{key}"))
    elif isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        found[prefix] = local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    elif isinstance(tree, io.BytesIO):
        found[prefix] = tree.getvalue()
    elif tree is not None:
        found[prefix] = repr(tree).encode()
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--save-mode", choices=("sync", "thread", "process"), default="sync")
    parser.add_argument("--ids", choices=("step", "auto"), default="step")
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--ready-dir", default=None)
    parser.add_argument("--check-saves", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = sharded(build_model(), world_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    app = AppState(model, optimizer)
    train_state = {"step": 0, "loader": io.BytesIO(b"")}
    state = {"app": app, "train": train_state}

    if os.path.isdir(args.root) and open_tier(args.root).committed_steps():  # resume from the newest step
        dcp.load(state, storage_reader=CkptdStorageReader(args.root))
    first = int(train_state["step"]) + 1

    writer = CkptdStorageWriter()  # one writer for every save, as a trainer keeps it
    # As torchtitan does: async_save's collectives run on their own gloo group, never on the one the
    # training thread's FSDP collectives use at the same time.
    save_group = dist.new_group(backend="gloo") if args.save_mode == "thread" else None
    pending: Any = None
    saved: list[tuple[dict[str, bytes], Any]] = []  # (bytes held at the save, its metadata or future)
    for step in range(first, args.steps + 1):
        loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every:
            continue
        if pending is not None:
            pending.result()  # torchtitan waits for the previous async save before the next one
        train_state["step"] = step
        train_state["loader"] = io.BytesIO(f"samples-seen={step * 8 * world_size}".encode())
        held = _local_bytes({"app": app.state_dict(), "train": train_state}) if args.check_saves else {}
        checkpoint_id = f"{args.root}/{step_dir(step)}" if args.ids == "step" else args.root
        if args.save_mode == "sync":
            saved.append((held, dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=writer)))
        else:
            kind = AsyncCheckpointerType.PROCESS if args.save_mode == "process" else AsyncCheckpointerType.THREAD
            pending = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=writer,
                                     async_checkpointer_type=kind, process_group=save_group)
            saved.append((held, pending))
        if args.kill_after == step:
            if pending is not None:
                pending.result()  # done on every rank only once the coordinator committed the step
            with open(os.path.join(args.ready_dir, f"committed-{rank}"), "w", encoding="utf-8"):
                pass
            while True:  # killed by the launcher
                time.sleep(1)
    if pending is not None:
        pending.result()
    writer.close()

    checked = []
    for expected, result in saved if args.check_saves else []:
        metadata = result.result() if hasattr(result, "result") else result
        fresh_model = sharded(build_model(), world_size)
        fresh = AppState(fresh_model, torch.optim.Adam(fresh_model.parameters(), lr=0.01))
        loaded = {"app": fresh, "train": {"step": -1, "loader": io.BytesIO()}}
        dcp.load(loaded, checkpoint_id=metadata.storage_meta.checkpoint_id, storage_reader=CkptdStorageReader())
        actual = _local_bytes({"app": fresh.state_dict(), "train": loaded["train"]})
        if actual != expected:
            raise SystemExit(f"rank {rank}: {metadata.storage_meta.checkpoint_id} loads back other bytes: "
                             f"{sorted(k for k in expected if actual.get(k) != expected[k])}")
        checked.append(metadata.storage_meta.checkpoint_id.rsplit("/", 1)[-1])

    full = {name: (value.full_tensor() if isinstance(value, DTensor) else value).contiguous()
            for name, value in get_state_dict(model, optimizer)[0].items()}
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"first_step": first, "checked_saves": checked,
                       "weights": {name: t.view(torch.uint8).numpy().tobytes().hex() for name, t in full.items()}},
                      handle)
    dist.destroy_process_group()


def launch_ranks(world_size: int, argv: list[str], *, timeout_s: float = 150.0,
                 kill_when_ready: str | None = None) -> list[int]:
    """Run this module on ``world_size`` real processes (not daemonic, so that DCP's checkpoint
    process may start); returns their exit codes. With ``kill_when_ready`` (the ``--ready-dir``), every
    rank is sent SIGKILL once all of them wrote their ``committed-<rank>`` file there (exit code -9)."""
    from ckptd.testing.multirank import free_port

    port = free_port()
    deadline = time.monotonic() + timeout_s
    processes = []
    for rank in range(world_size):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                        LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(subprocess.Popen([sys.executable, "-m", "harness.dcp_training", *argv],
                                          env=rank_env))
    try:
        while kill_when_ready is not None and time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(kill_when_ready, f"committed-{r}")) for r in range(world_size)):
                for process in processes:
                    process.send_signal(signal.SIGKILL)
                break
            if any(process.poll() is not None for process in processes):
                break
            time.sleep(0.05)
        codes = [process.wait(timeout=max(1.0, deadline - time.monotonic())) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes


if __name__ == "__main__":
    main()
