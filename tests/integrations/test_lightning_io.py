"""``CkptdCheckpointIO`` in one process: what each CheckpointIO call does to the tiers and the pointers.

Checkpoint dicts here have the shape Lightning gives them (``state_dict``, ``optimizer_states`` with
integer keys, ``loops``, ``callbacks`` with tensors, ``hyper_parameters``); one test runs a real
``Trainer`` to resume from an explicit path.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptd.errors import CkptdError, CommitError, FormatError, NotFoundError, PickleRefusedError
from ckptd.format.layout import step_dir
from ckptd.plugins.lightning import CkptdCheckpointIO
from ckptd.testing.compare import state_differences
from ckptd.testing.multirank import run_multirank
from lightning_run import STEPS_PER_EPOCH, TinyData, TinyModel


def _checkpoint(step: int, **extra: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "epoch": step // 8, "global_step": step, "pytorch-lightning_version": L.__version__,
        "state_dict": collections.OrderedDict(weight=torch.randn(4, 3, generator=generator), bias=torch.zeros(4)),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": step // 8, "completed": step // 8}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "kth_value": torch.tensor(float("inf")),
                                                           "dirpath": "/somewhere"}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4, 3)}},
                              "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}]}],
        "lr_schedulers": [{"step_size": 1, "gamma": 0.8, "last_epoch": step // 8}],
        "hparams_name": "kwargs", "hyper_parameters": {"width": 16},
        **extra,
    }


def _steps(local: Path) -> list[str]:
    return sorted(name for name in os.listdir(local) if name.startswith("step-"))


def test_a_checkpoint_roundtrips_with_its_types(tmp_path: Path) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    saved = _checkpoint(8)
    io.save_checkpoint(saved, tmp_path / "lc" / "epoch=0-step=8.ckpt")
    io.teardown()
    loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(tmp_path / "lc" / "epoch=0-step=8.ckpt")
    assert state_differences(loaded, saved) == []
    assert isinstance(loaded["state_dict"], collections.OrderedDict)
    assert list(loaded["optimizer_states"][0]["state"]) == [0], "integer keys stay integers"
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_paths_at_one_step_share_it_and_removed_steps_leave_the_tier(tmp_path: Path) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    lc = tmp_path / "lc"
    for step in (8, 16, 24):
        io.save_checkpoint(_checkpoint(step), lc / f"step={step}.ckpt")
        io.save_checkpoint(_checkpoint(step), lc / "last.ckpt")  # ModelCheckpoint's save_last: same step
        if step > 8:
            io.remove_checkpoint(lc / f"step={step - 8}.ckpt")
        io.manager.wait()
    assert sorted(os.listdir(lc)) == ["last.ckpt", "step=24.ckpt"]
    # step 16 was released after the commit of 24: it goes at the next commit's retention pass
    io.save_checkpoint(_checkpoint(32), lc / "step=32.ckpt")
    io.teardown()
    assert _steps(tmp_path / "ckpt") == [step_dir(24), step_dir(32)]


def test_a_weights_only_save_does_not_stand_in_for_a_full_one(tmp_path: Path) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    full = _checkpoint(8)
    io.save_checkpoint({key: full[key] for key in ("epoch", "global_step", "state_dict")}, tmp_path / "weights.ckpt")
    with pytest.raises(CommitError, match="saved already without") as caught:
        io.save_checkpoint(full, tmp_path / "full.ckpt")
    assert "optimizer_states" in str(caught.value) and not (tmp_path / "full.ckpt").exists()
    io.save_checkpoint({key: full[key] for key in ("global_step", "state_dict")}, tmp_path / "fewer.ckpt")
    io.teardown()


def test_a_pointer_to_a_step_that_never_committed_falls_back_to_the_newest_older(tmp_path: Path, caplog) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    io.save_checkpoint(_checkpoint(8), tmp_path / "lc" / "a.ckpt")
    io.teardown()
    # the pointer of a save whose process died before the commit: written, its step never committed
    (tmp_path / "lc" / "last.ckpt").write_text('{"format": "ckptd-lightning-pointer/1", "step": 16}')
    with caplog.at_level(logging.WARNING, logger="ckptd.plugins.lightning"):
        loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(tmp_path / "lc" / "last.ckpt")
    assert loaded["global_step"] == 8 and state_differences(loaded, _checkpoint(8)) == []
    assert "points to ckptd step 16" in caplog.text and "restoring step 8" in caplog.text


def test_paths_that_hold_no_pointer_are_refused_clearly(tmp_path: Path) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(FormatError, match="not a ckptd checkpoint pointer") as caught:
        io.load_checkpoint(tmp_path / "plain.ckpt")
    assert "plain.ckpt" in str(caught.value)
    with pytest.raises(NotFoundError, match="no Lightning checkpoint at this path"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "nothing.ckpt").write_text('{"format": "ckptd-lightning-pointer/1", "step": 3}')
    with pytest.raises(NotFoundError, match="no tier holds intact"):
        CkptdCheckpointIO(tmp_path / "empty").load_checkpoint(tmp_path / "nothing.ckpt")
    io.teardown()


def test_values_that_need_pickle_are_refused_unless_allowed(tmp_path: Path) -> None:
    class Settings:  # an object in hyper_parameters: only pickle can save it
        width = 16

    io = CkptdCheckpointIO(tmp_path / "ckpt")
    with pytest.raises(PickleRefusedError, match="hyper_parameters/settings"):
        io.save_checkpoint(_checkpoint(8, hyper_parameters={"settings": Settings()}), tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists(), "no pointer to a step that was not saved"
    io.teardown()
    allowed = CkptdCheckpointIO(tmp_path / "other", allow_pickle=True)
    allowed.save_checkpoint(_checkpoint(8, hyper_parameters={"width": 3, "dtype": torch.float16}), tmp_path / "b.ckpt")
    allowed.teardown()
    assert CkptdCheckpointIO(tmp_path / "other").load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"] == \
        {"width": 3, "dtype": torch.float16}


def test_a_step_an_earlier_run_committed_is_never_overwritten(tmp_path: Path) -> None:
    first = CkptdCheckpointIO(tmp_path / "ckpt")
    for step in (8, 16):
        first.save_checkpoint(_checkpoint(step), tmp_path / f"{step}.ckpt")
    first.teardown()
    again = CkptdCheckpointIO(tmp_path / "ckpt")
    again.load_checkpoint(tmp_path / "8.ckpt")  # resumed from the older one: training re-reaches step 16
    with pytest.raises(CommitError, match="global step 16 is committed already") as caught:
        again.save_checkpoint(_checkpoint(16, epoch=99), tmp_path / "16-again.ckpt")
    assert "new directory" in str(caught.value)
    again.teardown()
    loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(tmp_path / "16.ckpt")
    assert state_differences(loaded, _checkpoint(16)) == []


def _trainer(io: CkptdCheckpointIO, dirpath: Path, epochs: int) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, plugins=[io], deterministic=True, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(dirpath),
                     callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1)])


def test_fit_resumes_from_an_explicit_path(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(3)
    first = _trainer(CkptdCheckpointIO(tmp_path / "ckpt"), tmp_path / "lc", 2)
    first.fit(TinyModel(), datamodule=TinyData())
    explicit = tmp_path / "lc" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    assert explicit.exists() and _steps(tmp_path / "ckpt") == [step_dir(8), step_dir(16)]
    model = TinyModel()
    second = _trainer(CkptdCheckpointIO(tmp_path / "ckpt"), tmp_path / "lc", 3)
    second.fit(model, datamodule=TinyData(), ckpt_path=str(explicit))
    assert second.global_step == 3 * STEPS_PER_EPOCH
    assert _steps(tmp_path / "ckpt") == [step_dir(8), step_dir(16), step_dir(24)], "save_top_k=-1 keeps every step"
    loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(tmp_path / "lc" / "epoch=2-step=24.ckpt")
    assert state_differences(loaded["state_dict"], model.state_dict()) == []
    assert loaded["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2


def _load_on_every_rank(rank: int, world_size: int, local: str, paths: list[str]) -> list[tuple[Any, ...]]:
    outcomes: list[tuple[Any, ...]] = []
    for path in paths:
        io = CkptdCheckpointIO(local)
        try:
            loaded = io.load_checkpoint(path)
            outcomes.append(("ok", state_differences(loaded, _checkpoint(8)), io._manager is not None))
        except CkptdError as error:
            outcomes.append(("error", str(error), io._manager is not None))
        io.teardown()
    return outcomes


def test_under_ddp_rank_zero_reads_and_the_other_ranks_receive(tmp_path: Path) -> None:
    io = CkptdCheckpointIO(tmp_path / "ckpt")
    io.save_checkpoint(_checkpoint(8), tmp_path / "lc" / "last.ckpt")
    io.teardown()
    paths = [str(tmp_path / "lc" / "last.ckpt"), str(tmp_path / "lc" / "gone.ckpt")]
    (zero_ok, zero_missing), (one_ok, one_missing) = run_multirank(_load_on_every_rank, 2, str(tmp_path / "ckpt"),
                                                                   paths)
    assert zero_ok == ("ok", [], True) and one_ok == ("ok", [], False), \
        "rank 1 got the checkpoint without opening the tiers"
    assert zero_missing[0] == one_missing[0] == "error"
    assert "no Lightning checkpoint at this path" in zero_missing[1]
    assert "rank 0 could not load the checkpoint" in one_missing[1] and "gone.ckpt" in one_missing[1]


def test_after_a_resume_a_step_another_pointer_of_the_earlier_run_names_is_kept(tmp_path: Path) -> None:
    lc = tmp_path / "lc"
    earlier = CkptdCheckpointIO(tmp_path / "ckpt")
    earlier.save_checkpoint(_checkpoint(8), lc / "every-step=8.ckpt")  # save_top_k=-1: kept for good
    earlier.save_checkpoint(_checkpoint(8), lc / "last.ckpt")
    earlier.save_checkpoint(_checkpoint(8), lc / "top-step=8.ckpt")
    earlier.teardown()
    resumed = CkptdCheckpointIO(tmp_path / "ckpt")
    resumed.load_checkpoint(lc / "last.ckpt")
    for step in (16, 24, 32):  # last.ckpt moves on; every-step=8.ckpt still names step 8
        resumed.save_checkpoint(_checkpoint(step), lc / f"every-step={step}.ckpt")
        resumed.save_checkpoint(_checkpoint(step), lc / "last.ckpt")
        resumed.manager.wait()
    assert step_dir(8) in _steps(tmp_path / "ckpt"), "a step a kept pointer names was deleted"
    resumed.remove_checkpoint(lc / "every-step=8.ckpt")  # the earlier run's paths are released like its own
    resumed.remove_checkpoint(lc / "top-step=8.ckpt")
    resumed.save_checkpoint(_checkpoint(40), lc / "last.ckpt")
    resumed.teardown()
    assert step_dir(8) not in _steps(tmp_path / "ckpt"), "no pointer names step 8 any more"
    loaded = CkptdCheckpointIO(tmp_path / "ckpt").load_checkpoint(lc / "every-step=16.ckpt")
    assert state_differences(loaded, _checkpoint(16)) == []


def test_a_run_that_lost_its_node_and_its_pointers_does_not_save_over_the_object_tier(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    remote = f"s3://{s3_bucket}/lost-node"
    earlier = CkptdCheckpointIO(tmp_path / "ckpt", remote=remote, storage_options=s3_options)
    for step in (8, 16):
        earlier.save_checkpoint(_checkpoint(step), tmp_path / "lc" / f"step={step}.ckpt")
    earlier.teardown()
    shutil.rmtree(tmp_path / "ckpt")  # the node is gone, the ModelCheckpoint directory (its disk) with it
    shutil.rmtree(tmp_path / "lc")
    fresh = CkptdCheckpointIO(tmp_path / "ckpt", remote=remote, storage_options=s3_options)
    fresh.save_checkpoint(_checkpoint(4, epoch=0), tmp_path / "lc" / "step=4.ckpt")  # no step of S3: saved
    with pytest.raises(CommitError, match="committed already on the object tier") as caught:
        fresh.save_checkpoint(_checkpoint(8, epoch=7), tmp_path / "lc" / "step=8.ckpt")  # started over from scratch
    assert "ckpt_path='last'" in caught.value.hint and not (tmp_path / "lc" / "step=8.ckpt").exists()
    fresh.teardown()
    (tmp_path / "lc" / "again.ckpt").write_text('{"format": "ckptd-lightning-pointer/1", "step": 8}')
    shutil.rmtree(tmp_path / "ckpt")
    loaded = CkptdCheckpointIO(tmp_path / "ckpt", remote=remote, storage_options=s3_options).load_checkpoint(
        tmp_path / "lc" / "again.ckpt")
    assert state_differences(loaded, _checkpoint(8)) == [], "the earlier run's step 8 is intact on S3"


class _ValidatedModel(TinyModel):
    def validation_step(self, batch, batch_index):
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(inputs), targets))


class _ValidatedData(TinyData):
    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=16)


def _two_checkpoints(root: Path, epochs: int) -> L.Trainer:
    """A batch-end and a validation-end ModelCheckpoint: both save at the last batch's global step."""
    return L.Trainer(max_epochs=epochs, plugins=[CkptdCheckpointIO(root / "ckpt")], deterministic=True,
                     accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root),
                     callbacks=[ModelCheckpoint(dirpath=root / "lc", filename="batch-{step}",
                                                every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1),
                                ModelCheckpoint(dirpath=root / "lc", filename="val-{epoch}", monitor="val_loss")])


def test_the_later_save_at_one_step_resumes_through_the_shared_first_one_like_an_uninterrupted_run(
        tmp_path: Path) -> None:
    """The validation-end path shares the batch-end save of its global step (taken before validation): a resume
    from it runs that validation and the epoch end again, and ends where an uninterrupted run ends."""
    torch.set_num_threads(1)
    L.seed_everything(5)
    uninterrupted = _ValidatedModel(dropout=0.3)
    _two_checkpoints(tmp_path / "a", 3).fit(uninterrupted, datamodule=_ValidatedData())
    L.seed_everything(5)
    _two_checkpoints(tmp_path / "b", 1).fit(_ValidatedModel(dropout=0.3), datamodule=_ValidatedData())
    later = tmp_path / "b" / "lc" / "val-epoch=0.ckpt"
    assert json.loads(later.read_text())["step"] == STEPS_PER_EPOCH
    L.seed_everything(5)
    resumed = _ValidatedModel(dropout=0.3)
    trainer = _two_checkpoints(tmp_path / "b", 3)
    trainer.fit(resumed, datamodule=_ValidatedData(), ckpt_path=str(later))
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    assert state_differences(resumed.state_dict(), uninterrupted.state_dict()) == []
