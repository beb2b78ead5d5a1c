"""``ModelCheckpoint(save_top_k=2, monitor=...)`` through ``CkptdCheckpointIO``: after fit, each tier holds
exactly the ckptd steps the remaining pointers name, also when the last save made Lightning remove an
older checkpoint (no later save follows to run the retention); and ``Model.load_from_checkpoint`` on a
pointer loads the weights through ckptd.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptd.errors import FormatError
from ckptd.format.layout import step_dir
from ckptd.plugins.lightning import CkptdCheckpointIO
from ckptd.testing.compare import state_differences
from ckptd.tiers import open_tier
from lightning_run import STEPS_PER_EPOCH, TinyData, TinyModel

EVERY, EPOCHS = 2, 2  # saves at steps 2, 4, ..., 16


class ScoredModel(TinyModel):
    """Logs a score that improves at every step, so that each save pushes the oldest of the top 2 out."""

    def training_step(self, batch, batch_index):
        self.log("score", float(-self.global_step))
        return super().training_step(batch, batch_index)


class UploadedBeforeRemoval(CkptdCheckpointIO):
    """Each save returns once its step is committed and promoted (a fast object store): the retention that
    follows a promotion has run before ModelCheckpoint removes the checkpoint the save pushed out."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.manager.wait_uploads()


def _fit(root: Path, io: type[CkptdCheckpointIO] = CkptdCheckpointIO, **io_options: Any
         ) -> tuple[L.Trainer, ScoredModel]:
    torch.set_num_threads(1)
    L.seed_everything(2)
    checkpoints = ModelCheckpoint(dirpath=root / "lc", monitor="score", mode="min", save_top_k=2,
                                  every_n_train_steps=EVERY, filename="{step}")
    trainer = L.Trainer(max_epochs=EPOCHS, plugins=[io(root / "ckpt", **io_options)],
                        callbacks=[checkpoints], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    model = ScoredModel()
    trainer.fit(model, datamodule=TinyData())
    return trainer, model


def _named_steps(lc: Path) -> list[int]:
    return sorted({json.loads((lc / name).read_text())["step"] for name in os.listdir(lc)})


def test_save_top_k_leaves_exactly_the_named_steps_on_the_local_and_object_tiers(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    remote = f"s3://{s3_bucket}/top-k"
    trainer, _ = _fit(tmp_path, UploadedBeforeRemoval, remote=remote, storage_options=s3_options)
    last = EPOCHS * STEPS_PER_EPOCH
    assert trainer.global_step == last
    assert sorted(os.listdir(tmp_path / "lc")) == [f"step={last - EVERY}.ckpt", f"step={last}.ckpt"], \
        "the last save removed the checkpoint of step 12"
    named = _named_steps(tmp_path / "lc")
    assert named == [last - EVERY, last]
    local = sorted(name for name in os.listdir(tmp_path / "ckpt") if name.startswith("step-"))
    assert local == [step_dir(step) for step in named]
    tier = open_tier(remote, storage_options=s3_options)
    try:
        assert tier.committed_steps() == named, "the object tier keeps exactly the named steps too"
    finally:
        tier.close()


def test_load_from_checkpoint_on_a_pointer_loads_the_weights_through_ckptd(tmp_path: Path) -> None:
    trainer, model = _fit(tmp_path)
    best = trainer.checkpoint_callback.best_model_path
    assert json.loads(Path(best).read_text())["step"] == EPOCHS * STEPS_PER_EPOCH, "a pointer, not a torch file"
    torch.save({"state_dict": model.state_dict(), "pytorch-lightning_version": L.__version__,
                "hyper_parameters": dict(model.hparams)}, tmp_path / "torch.ckpt")
    torch.manual_seed(123)
    ScoredModel.load_from_checkpoint(tmp_path / "torch.ckpt")  # building the model draws; reading draws nothing
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    loaded = ScoredModel.load_from_checkpoint(best)
    assert torch.equal(torch.rand(3), expected_draw), "reading through ckptd changed the caller's RNG"
    assert state_differences(loaded.state_dict(), model.state_dict()) == []
    assert dict(loaded.hparams) == dict(model.hparams)
    assert sorted(name for name in os.listdir(tmp_path / "ckpt") if name.startswith("step-")) == \
        [step_dir(step) for step in _named_steps(tmp_path / "lc")], "reading deleted nothing"

    # any other file still goes to Lightning's own loader
    assert state_differences(ScoredModel.load_from_checkpoint(tmp_path / "torch.ckpt").state_dict(),
                             model.state_dict()) == []
    (tmp_path / "nameless.ckpt").write_text('{"format": "ckptd-lightning-pointer/1", "step": 16}')
    with pytest.raises(FormatError, match="not the ckptd root") as caught:
        ScoredModel.load_from_checkpoint(tmp_path / "nameless.ckpt")
    assert "load_checkpoint" in caught.value.hint
