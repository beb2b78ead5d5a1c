"""One run of a script in the shape of accelerate's checkpointing example, in a fresh interpreter per rank.

``python accelerate_run.py CONFIG_JSON``: ``Accelerator()``, ``set_seed``, a map-style dataset in a
``DataLoader(dataset, shuffle=True, batch_size=4, num_workers=2)`` and nothing else (no seedable sampler, no
generator, no ``set_epoch``), a small MLP with dropout (the RNG states matter), AdamW and a linear schedule,
``accelerator.prepare``, a loop over epochs with ``for batch in train_dataloader`` and
``accelerator.save_state(f"{output_dir}/step_{overall_step}")`` every ``save_every`` steps. With ``local``
the saves go through :class:`CkptdAccelerate`, and a run with ``resume`` starts with ``hooks.restore()``:
``overall_step`` is the step it returns and ``starting_epoch = overall_step // len(train_dataloader)``, no
``skip_first_batches``. ``stateful`` and ``persistent_workers`` turn on accelerate's
``use_stateful_dataloader`` and the DataLoader's ``persistent_workers``. A run with ``kill_at`` sends itself
SIGKILL at the start of that step, once the saves before it committed (with several ranks every rank waits for
the others first: the whole job dies).

Each rank records the sample ids and a hash of every batch it trains on (one line per batch, one file per
run and rank) and, at the end, its weights, optimizer and scheduler states. :func:`run` starts
``world_size`` ranks (torchrun's environment variables; accelerate uses gloo on CPU). One intra-op thread:
CPU arithmetic is deterministic and runs compare bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rank_runs import run_ranks  # this folder

SAMPLES, BATCH, EPOCHS = 40, 4, 3


def training_function(config: dict[str, Any]) -> None:
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    from ckptd.plugins.huggingface import CkptdAccelerate

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))

    class Samples(torch.utils.data.Dataset):
        """Sample ``index``: features drawn once from a fixed generator, a target, and the index."""

        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(1234)
            self.features = torch.randn(SAMPLES, 8, generator=generator)
            self.targets = self.features @ torch.randn(8, 1, generator=generator)

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"x": self.features[index], "y": self.targets[index], "idx": index}

    dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True) if config.get("stateful") else None
    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config)
    set_seed(42)
    options = {"persistent_workers": True} if config.get("persistent_workers") else {}
    train_dataloader = torch.utils.data.DataLoader(Samples(), shuffle=True, batch_size=BATCH, num_workers=2, **options)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    total = EPOCHS * len(train_dataloader) // accelerator.num_processes
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=total)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)

    overall_step = 0
    hooks = CkptdAccelerate(accelerator, config["local"], step=lambda: overall_step) if config.get("local") else None
    starting_epoch = 0
    if hooks is not None and config.get("resume"):
        overall_step = hooks.restore() or 0
        starting_epoch = overall_step // len(train_dataloader)
    resumed_from = overall_step
    output_dir = config["output_dir"]
    batches_log = Path(config["batches_log"].format(rank=rank))
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        for batch in train_dataloader:
            if config.get("kill_at") == overall_step + 1:
                hooks.manager.wait()
                accelerator.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
            digest = hashlib.sha256(batch["x"].numpy().tobytes() + batch["y"].numpy().tobytes()).hexdigest()
            with batches_log.open("a", encoding="utf-8") as out:
                out.write(json.dumps({"step": overall_step + 1, "epoch": epoch, "ids": batch["idx"].tolist(),
                                      "sha256": digest}) + "\n")
            outputs = model(batch["x"])
            loss = torch.nn.functional.mse_loss(outputs, batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if hooks is not None and overall_step % config["save_every"] == 0:
                accelerator.save_state(os.path.join(output_dir, f"step_{overall_step}"))
    if hooks is not None:
        hooks.close()
    torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": lr_scheduler.state_dict(), "resumed_from": resumed_from, "steps": overall_step},
               config["final"].format(rank=rank))


def run(directory: Path, *, world_size: int = 1, timeout_s: float = 300,
        **config: Any) -> list[subprocess.CompletedProcess[str]]:
    """One run of ``world_size`` ranks writing into ``directory`` (its n-th run: ``batches-n-RANK.jsonl``,
    ``final-n-RANK.pt``); the finished processes, by rank."""
    directory.mkdir(parents=True, exist_ok=True)
    number = len(list(directory.glob("config-*.json")))
    config.setdefault("output_dir", str(directory / "out"))
    config.update(batches_log=str(directory / f"batches-{number}-{{rank}}.jsonl"),
                  final=str(directory / f"final-{number}-{{rank}}.pt"))
    config_file = directory / f"config-{number}.json"
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_DAEMON="off")
    return run_ranks(Path(__file__), config_file, world_size=world_size, env=env, timeout_s=timeout_s)


def batches(directory: Path, number: int, rank: int = 0) -> list[dict[str, Any]]:
    """What rank ``rank`` of the ``number``-th run in ``directory`` trained on, batch by batch."""
    path = directory / f"batches-{number}-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final(directory: Path, number: int, rank: int = 0) -> dict[str, Any]:
    """The weights, optimizer and scheduler states rank ``rank`` of that run ended with."""
    import torch

    return torch.load(directory / f"final-{number}-{rank}.pt")


if __name__ == "__main__":
    training_function(json.loads(Path(sys.argv[1]).read_text()))
