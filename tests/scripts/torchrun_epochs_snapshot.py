"""A second torchrun-style script (no ckptd import), of the other usual shape: epochs over a dataset with a
``DistributedSampler``, Adam, ``init_process_group(backend="gloo", init_method="env://")``, a snapshot saved
by rank 0 after each epoch (then a barrier) and loaded at start.

``python torchrun_epochs_snapshot.py OUT EPOCHS``: every rank appends ``<pid> <step> <unix time>`` to
``OUT/progress-rank<r>`` after each step (steps counted over all epochs); rank 0 writes the final weights and
optimizer state as hex bytes to ``OUT/final.json``.
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from script_pacing import pace  # the tests' hook (this folder)


def main() -> None:
    out, epochs = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(backend="gloo", init_method="env://")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    data = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 6, generator=data)
    dataset = TensorDataset(inputs, (inputs[:, :3].sum(1) > 0).long())
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    snapshot_path = os.path.join(out, "snapshot.pt")
    first_epoch = 0
    if os.path.exists(snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first_epoch = snapshot["epochs_run"]
    model = DistributedDataParallel(model, device_ids=None)
    steps_per_epoch = len(loader)
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with open(os.path.join(out, f"progress-rank{rank}"), "a") as progress:
                progress.write(f"{os.getpid()} {epoch * steps_per_epoch + index + 1} {time.time():.6f}\n")
            pace(out, rank, epoch * steps_per_epoch + index + 1)
        if local_rank == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epochs_run": epoch + 1}, snapshot_path + ".tmp")
            os.replace(snapshot_path + ".tmp", snapshot_path)
        dist.barrier()
    if rank == 0:
        state = {name: tensor.numpy().tobytes().hex() for name, tensor in model.module.state_dict().items()}
        for index, moments in optimizer.state_dict()["state"].items():
            state.update({f"adam.{index}.{key}": value.numpy().tobytes().hex() for key, value in moments.items()})
        with open(os.path.join(out, "final.json"), "w") as written:
            json.dump(state, written, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
