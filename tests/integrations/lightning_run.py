"""One Lightning training run for the integration tests, as a child process.

``python lightning_run.py CONFIG_JSON``: trains a tiny MLP (Adam, StepLR, a shuffled DataLoader, a data
module with state) on CPU with ``CkptdCheckpointIO`` and ``ModelCheckpoint`` saving every epoch
(``every_n_train_steps`` = batches per epoch), resuming with ``ckpt_path`` from the config. Writes the
final weights (``torch.save`` of the state dict) and a JSON summary (where fit started, what the data
module received, which tiers the restore read). With ``block_after_step`` it stops at the start of that step, once every checkpoint saved before it is
committed, writes ``ready`` and waits to be SIGKILLed. With ``devices`` > 1 it runs DDP on CPU (gloo); the
other ranks write ``summary-rank<r>.json``.

``loader`` picks the data module's training loader, in the shape of Lightning's examples:
``"plain"`` (``DataLoader(shuffle=True)``, the default), ``"stateful"`` (torchdata's
``StatefulDataLoader(shuffle=True)``; with ``sampler="resumable"`` ckptd's
``ResumableDistributedSampler`` in place of ``shuffle=True``) or ``"shard"`` (ckptd's ``LightningShardLoader`` over the jsonl shards at
``shards``, indexed by the test), or ``"both"`` (those two at once, as a dict of loaders);
``num_workers`` goes to each. Every rank appends the hash of each batch it
trains (with the global step) to ``batches-rank<r>.jsonl``, flushed per line so that a SIGKILL keeps
them; rank 0 saves the final weights, optimizer and scheduler states to ``final.pt``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptd.data import ShardDataset
from ckptd.plugins.lightning import CkptdCheckpointIO, LightningShardLoader, ResumableDistributedSampler

BATCH, SAMPLES = 8, 64
STEPS_PER_EPOCH = SAMPLES // BATCH


class TinyModel(L.LightningModule):
    def __init__(self, width: int = 16, dropout: float = 0.0, rank_seed: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.rank_seed = rank_seed
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(width, 1))

    def setup(self, stage: str) -> None:  # per-rank randomness (dropout masks differ between the ranks)
        if self.rank_seed is not None:
            torch.manual_seed(self.rank_seed + self.global_rank)

    #: Where each rank appends the hashes of the batches it trains (``main`` sets it; None: nowhere).
    batch_log_dir: str | None = None

    def on_train_start(self) -> None:
        if self.batch_log_dir is not None:
            log = Path(self.batch_log_dir) / f"batches-rank{self.global_rank}.jsonl"
            self.batch_log = open(log, "a", encoding="utf-8")  # noqa: SIM115  (closed by the process's end)

    def training_step(self, batch, batch_index):
        inputs, targets = batch_inputs(batch)
        if hasattr(self, "batch_log"):
            digest = hashlib.sha256(inputs.numpy().tobytes() + targets.numpy().tobytes()).hexdigest()
            self.batch_log.write(json.dumps({"step": self.trainer.global_step, "hash": digest}) + "\n")
            self.batch_log.flush()
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)}


def shard_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and targets of a batch of the jsonl shards (``shard`` and ``index`` numbers per sample)."""
    where = (batch["shard"] * 100 + batch["index"]).to(torch.float32).unsqueeze(1)
    inputs = torch.sin(where * torch.arange(1, 9, dtype=torch.float32) * 0.1)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def batch_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and targets of a batch of any of the data module's loaders (of both, concatenated)."""
    if isinstance(batch, dict) and "shard" in batch and "stateful" in batch:
        parts = [batch_inputs(batch["stateful"]), batch_inputs(batch["shard"])]
        return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
    return shard_inputs(batch) if isinstance(batch, dict) else batch


class TinyData(L.LightningDataModule):
    def __init__(self, loader: str = "plain", num_workers: int = 0, shards: str | None = None,
                 sampler: str | None = None) -> None:
        super().__init__()
        self.loader, self.num_workers, self.shards, self.sampler = loader, num_workers, shards, sampler
        generator = torch.Generator().manual_seed(1234)
        inputs = torch.randn(SAMPLES, 8, generator=generator)
        self.dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
        self.loaders_made = 0
        self.loaded_state: dict | None = None

    def train_dataloader(self):
        self.loaders_made += 1
        if self.loader == "both":  # two loaders at once (Lightning combines them): each keeps its own position
            return {"stateful": self._loader("stateful"), "shard": self._loader("shard")}
        return self._loader(self.loader)

    def _loader(self, kind: str):
        if kind == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            if self.sampler == "resumable":  # the sampler that makes DDP exact (plugins/lightning/sampler.py)
                return StatefulDataLoader(self.dataset, batch_size=BATCH, sampler=ResumableDistributedSampler(
                    self.dataset), num_workers=self.num_workers)
            return StatefulDataLoader(self.dataset, batch_size=BATCH, shuffle=True, num_workers=self.num_workers)
        if kind == "shard":
            world = self.trainer.world_size if self.trainer is not None else 1
            return LightningShardLoader(ShardDataset(self.shards, global_batch_size=BATCH * world, seed=5),
                                        num_workers=self.num_workers)
        return DataLoader(self.dataset, batch_size=BATCH, shuffle=True, num_workers=self.num_workers)

    def state_dict(self):
        return {"loaders_made": self.loaders_made, "note": "tiny"}

    def load_state_dict(self, state):
        self.loaded_state = dict(state)
        self.loaders_made = int(state["loaders_made"])


class BlockAfter(Callback):
    """Stop after the checkpoint of ``step`` is committed: write ``ready`` and wait for SIGKILL."""

    def __init__(self, io: CkptdCheckpointIO, step: int, ready: Path) -> None:
        self.io, self.step, self.ready = io, step, ready

    def on_train_batch_start(self, trainer, *args) -> None:  # ModelCheckpoint saved at the previous batch's end
        if trainer.global_step == self.step:
            if trainer.is_global_zero:  # the one rank that saves
                self.io.manager.wait()
                self.ready.write_text(str(self.step))
            while True:
                time.sleep(1)


def main(config: dict) -> None:
    L.seed_everything(7, workers=True)
    torch.set_num_threads(1)
    out = Path(config["out"])
    io = CkptdCheckpointIO(config["local"], remote=config.get("remote"),
                           storage_options=config.get("storage_options"))
    checkpoints = ModelCheckpoint(dirpath=config["dirpath"], every_n_train_steps=config.get("every", STEPS_PER_EPOCH), save_top_k=1,
                                  save_last=True)
    callbacks: list[Callback] = [checkpoints]
    if config.get("block_after_step"):
        callbacks.append(BlockAfter(io, int(config["block_after_step"]), out / "ready"))
    devices = int(config.get("devices", 1))
    trainer = L.Trainer(max_epochs=config["max_epochs"], plugins=[io], callbacks=callbacks, deterministic=True,
                        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out))
    model = TinyModel(dropout=config.get("dropout", 0.0), rank_seed=config.get("rank_seed"))
    model.batch_log_dir = str(out)
    data = TinyData(config.get("loader", "plain"), int(config.get("num_workers", 0)), config.get("shards"),
                    config.get("sampler"))
    started: dict = {}

    class Started(Callback):
        def on_train_start(self, trainer, module) -> None:
            started.update(global_step=trainer.global_step, epoch=trainer.current_epoch,
                           lr=trainer.optimizers[0].param_groups[0]["lr"],
                           adam_steps=sorted(float(s["step"]) for s in trainer.optimizers[0].state.values()))
            report = io.manager.last_restore if trainer.is_global_zero else None
            if report is not None:
                started.update(restored_step=report.step, tiers=list(report.tiers))

    trainer.callbacks.append(Started())
    trainer.fit(model, datamodule=data, ckpt_path=config.get("ckpt_path"))
    if not trainer.is_global_zero:  # the other DDP ranks report what they resumed with, nothing else
        (out / f"summary-rank{trainer.global_rank}.json").write_text(json.dumps(
            {"started": started, "global_step": trainer.global_step, "data_state": data.loaded_state,
             "opened_manager": io._manager is not None,
             "weights": {name: value.tolist() for name, value in model.state_dict().items()}}))
        return
    torch.save({name: value.detach().clone() for name, value in model.state_dict().items()}, out / "weights.pt")
    torch.save({"weights": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}, out / "final.pt")
    summary = {"started": started, "global_step": trainer.global_step, "data_state": data.loaded_state}
    io.teardown()  # Lightning tore it down at the end of fit already: a second call does nothing
    (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
