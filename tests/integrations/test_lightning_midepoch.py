"""Lightning through ``CkptdCheckpointIO``: SIGKILL in the middle of an epoch, resume with
``ckpt_path="last"`` in a new process, and end bit for bit where an uninterrupted run ends: weights,
optimizer and scheduler, and the hash of every batch each rank trained.

The data module has two training loaders at once (``num_workers=2`` each; Lightning combines them), so
one run checks both: torchdata's ``StatefulDataLoader(shuffle=True)`` and ckptd's ``LightningShardLoader``;
Lightning saves their positions with its loops and ckptd saves those with the step.
One process and DDP on two gloo ranks (there ``StatefulDataLoader`` takes ckptd's
``ResumableDistributedSampler`` in place of ``shuffle=True``: see plugins/lightning/sampler.py). The model
has dropout, seeded per rank, so the ranks' RNG states count too. A plain ``DataLoader`` cannot resume inside
an epoch: the first save warns, once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from ckptd.data import index_dataset, save_dataset_manifest
from ckptd.data.testing import write_jsonl_shards
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.plugins.lightning import CkptdCheckpointIO, ResumableDistributedSampler
from ckptd.plugins.lightning.rank_rng import sampler_order_lost
from ckptd.testing.compare import state_differences
from lightning_jobs import batch_log, finish, kill_when_ready, start, trained_batches
from lightning_run import BATCH, TinyData, TinyModel

EVERY = 3  # checkpoints at steps 3, 6, 9...: none at an epoch's end


def _case(loader: str, devices: int) -> dict[str, Any]:
    """Steps per epoch: 8 in one process, 4 per rank with two. The kill lands two steps after a checkpoint
    in the middle of the second epoch (so the resume also repeats the steps trained after that checkpoint)."""
    if devices == 1:
        return {"loader": loader, "devices": 1, "max_epochs": 2, "restored": 9, "block": 11, "steps": 16}
    return {"loader": loader, "devices": 2, "max_epochs": 3, "restored": 6, "block": 7, "steps": 12}


CASES = [_case("both", 1), _case("both", 2)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("shards")
    write_jsonl_shards(root / "data", [17, 15, 16, 16])  # 64 samples: 8 global batches of 8
    manifest = root / "manifest.json"
    save_dataset_manifest(index_dataset(str(root / "data"), "jsonl").manifest, manifest)
    return str(manifest)


def _config(root: Path, case: dict[str, Any], shards: str, **extra: Any) -> dict[str, Any]:
    return {"out": str(root), "local": str(root / "ckpt"), "dirpath": str(root / "lightning"),
            "max_epochs": case["max_epochs"], "every": EVERY, "devices": case["devices"], "loader": case["loader"],
            "num_workers": 2, "shards": shards, "dropout": 0.3, "rank_seed": 100,
            "sampler": "resumable" if case["devices"] > 1 else None, **extra}


def _saved_loader_states(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The loaders' states Lightning put into the checkpoint ``last.ckpt`` names, as ckptd restores them."""
    io = CkptdCheckpointIO(config["local"])
    try:
        loaded = io.load_checkpoint(Path(config["dirpath"]) / "last.ckpt")
    finally:
        io.teardown()
    return loaded["loops"]["fit_loop"]["state_dict"]["combined_loader"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case['devices']}proc")
def test_sigkill_inside_an_epoch_then_resume_last_matches_uninterrupted(tmp_path: Path, shards: str,
                                                                       case: dict[str, Any]) -> None:
    reference_config = _config(tmp_path / "reference", case, shards)
    reference = start(reference_config)  # the uninterrupted run, alongside the one that is killed
    config = _config(tmp_path / "killed", case, shards, block_after_step=case["block"])
    restored = case["restored"]
    kill_when_ready(start(config), config, Path(config["local"]) / step_dir(restored) / MANIFEST_NAME)

    stateful, shard = _saved_loader_states(config)  # in ckptd's step, the workers' positions included
    assert sorted(stateful["_snapshot"]["_worker_snapshots"]) == ["worker_0", "worker_1"]
    assert stateful["_snapshot"]["_main_snapshot"]["_num_workers"] == 2
    per_epoch = 8 // case["devices"]
    assert stateful["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"] == restored - per_epoch
    assert (shard["epoch"], shard["samples_consumed"]) == (1, (restored - per_epoch) * BATCH * case["devices"])

    resumed = finish(start(_config(tmp_path / "killed", case, shards, ckpt_path="last")), config)
    assert resumed["started"]["restored_step"] == restored and resumed["global_step"] == case["steps"]
    uninterrupted = finish(reference, reference_config)
    assert uninterrupted["global_step"] == case["steps"]
    for rank in range(case["devices"]):
        expected = batch_log(tmp_path / "reference", rank)
        assert len(expected) == case["steps"]
        assert trained_batches(tmp_path / "killed", rank, restored) == expected, f"rank {rank}'s batches"
    final = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert state_differences(final, torch.load(tmp_path / "reference" / "final.pt", weights_only=True)) == []


def test_a_plain_shuffled_dataloader_is_named_once_at_the_first_save(tmp_path: Path, caplog) -> None:
    """Lightning's example default, ``DataLoader(shuffle=True)``: its position within an epoch is nowhere, so
    a mid-epoch resume cannot continue it; the first save says so once (not at every save)."""
    torch.set_num_threads(1)
    L.seed_everything(3)
    trainer = L.Trainer(max_epochs=1, plugins=[CkptdCheckpointIO(tmp_path / "ckpt")], accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path),
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "lc", every_n_train_steps=2, save_top_k=-1)])
    with caplog.at_level(logging.WARNING, logger="ckptd.loaders"):
        trainer.fit(TinyModel(), datamodule=TinyData())
    assert len(os.listdir(tmp_path / "lc")) == 4, "four saves"
    warnings = [record.getMessage() for record in caplog.records if record.name == "ckptd.loaders"]
    assert len(warnings) == 1, warnings
    assert "'train_dataloader'" in warnings[0] and "sampler=RandomSampler" in warnings[0]
    assert "StatefulDataLoader" in warnings[0]


def test_under_ddp_a_sampler_that_saves_no_epoch_is_named() -> None:
    dataset = torch.utils.data.TensorDataset(torch.zeros(16, 1))
    wrapped = StatefulDataLoader(dataset, sampler=DistributedSamplerWrapper(RandomSampler(dataset), num_replicas=2,
                                                                            rank=0))
    assert "DistributedSamplerWrapper" in sampler_order_lost(wrapped)
    plain = StatefulDataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True))
    assert "saves no epoch" in sampler_order_lost(plain)
    assert "ResumableDistributedSampler(dataset)" in sampler_order_lost(plain)
    resumable = StatefulDataLoader(dataset, sampler=ResumableDistributedSampler(dataset, num_replicas=2, rank=0))
    assert sampler_order_lost(resumable) is None
    in_order = StatefulDataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False))
    assert sampler_order_lost(in_order) is None
