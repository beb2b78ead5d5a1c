"""Lightning DDP (2 gloo ranks on CPU) through ``CkptdCheckpointIO``: every rank gets its own RNG back.

The model has dropout, seeded differently on each rank, so each rank draws its own masks. The job is
SIGKILLed (the whole process group, both ranks) right after a committed save, resumed in new processes
with ``ckpt_path="last"``, and must end with the weights of an uninterrupted 2-rank run, bit for bit: a
rank that resumed with another RNG state than it had at the save draws other masks, which changes the
averaged gradients. CPU arithmetic with one thread and a two-rank gloo all-reduce is reproducible.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.testing.compare import state_differences
from lightning_jobs import finish, free_port, kill_when_ready, start

STEPS_PER_EPOCH = 4  # 64 samples, batches of 8, split over 2 ranks
EPOCHS = 3


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    return {"out": str(root), "local": str(root / "ckpt"), "dirpath": str(root / "lightning"), "devices": 2,
            "max_epochs": EPOCHS, "every": STEPS_PER_EPOCH, "dropout": 0.5, "rank_seed": 100, **extra}


def _weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(Path(config["out"]) / "weights.pt", weights_only=True)


def test_ddp_ranks_with_their_own_dropout_resume_bit_for_bit_after_sigkill(tmp_path: Path) -> None:
    reference_config = _config(tmp_path / "reference")
    reference = start(reference_config)  # the uninterrupted run, alongside the one that is killed
    killed_at = STEPS_PER_EPOCH
    config = _config(tmp_path / "killed", block_after_step=killed_at)
    child = start(config)
    kill_when_ready(child, config, Path(config["local"]) / step_dir(killed_at) / MANIFEST_NAME)  # both ranks
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    resumed = finish(start(_config(tmp_path / "killed", ckpt_path="last")), config)
    assert resumed["started"]["restored_step"] == killed_at
    assert resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH
    rank_one = json.loads((tmp_path / "killed" / "summary-rank1.json").read_text())
    assert rank_one["started"]["global_step"] == killed_at and not rank_one["opened_manager"]
    uninterrupted = finish(reference, reference_config)
    assert uninterrupted["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert state_differences(_weights(config), _weights(reference_config)) == []


def test_ddp_spawn_copies_the_plugin_into_its_ranks_and_saves_through_ckptd(tmp_path: Path) -> None:
    """``strategy="ddp_spawn"`` pickles the trainer with its plugins into each rank's process."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptd.plugins.lightning import CkptdCheckpointIO
    from lightning_run import TinyData, TinyModel

    torch.set_num_threads(1)
    L.seed_everything(11)
    os.environ["MASTER_PORT"] = str(free_port())
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    model = TinyModel()
    trainer = L.Trainer(max_epochs=2, plugins=[io], strategy="ddp_spawn", accelerator="cpu", devices=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[ModelCheckpoint(
                            dirpath=tmp_path / "lc", every_n_train_steps=STEPS_PER_EPOCH, save_top_k=1)])
    trainer.fit(model, datamodule=TinyData())
    pointer = tmp_path / "lc" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    assert sorted(os.listdir(tmp_path / "lc")) == [pointer.name], "save_top_k=1 removed the older pointer"
    assert sorted(name for name in os.listdir(tmp_path / "ckpt") if name.startswith("step-")) == \
        [step_dir(2 * STEPS_PER_EPOCH)], "the ranks' retention deleted the older step"
    loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(pointer)
    assert state_differences(loaded["state_dict"], model.state_dict()) == [], "rank 0's weights, as fit returned them"
