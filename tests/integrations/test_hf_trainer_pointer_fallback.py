"""The Hugging Face Trainer: ``ckptd_resume(trainer, "…/checkpoint-6")`` when step 6 never committed resumes from
the previous committed step with the warning every integration gives (:mod:`ckptd.plugins.fallback`), and the
Trainer then trains on from that step, not from step 0.

A tiny GPT-2 built from a config (no download) on CPU; the lost step is one whose commit marker never reached
the disk (its manifest removed, as a kill between the data files and the commit leaves it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ckptd.format.layout import MANIFEST_NAME, step_dir

pytestmark = pytest.mark.integrations


def _trainer(output_dir: Path, callback: Any, max_steps: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, index: int) -> dict[str, Any]:
            ids = torch.arange(16, dtype=torch.long).add_(index).remainder_(64)
            return {"input_ids": ids, "labels": ids.clone()}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=2, seed=7, report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, save_strategy="steps", save_steps=2, max_steps=max_steps)
    return Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[callback])


def test_a_checkpoint_of_a_lost_step_resumes_from_the_previous_committed_one(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from ckptd.plugins.huggingface import CkptdCallback, ckptd_resume

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            _trainer(tmp_path / "out", callback, max_steps=6).train()
            assert callback.manager.committed_steps() == [4, 6]
        finally:
            callback.close()
        (tmp_path / "ckpt" / step_dir(6) / MANIFEST_NAME).unlink()  # step 6's commit never reached the disk

        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            trainer = _trainer(tmp_path / "out", callback, max_steps=6)
            pointer = tmp_path / "out" / "checkpoint-6"
            with caplog.at_level(logging.WARNING, logger="ckptd.plugins"):
                resume = ckptd_resume(trainer, pointer)
            (warning,) = [r.getMessage() for r in caplog.records if r.name == "ckptd.plugins"]
            assert str(pointer) in warning and "points to ckptd step 6" in warning and "restoring step 4" in warning
            assert resume is not None and Path(resume).name == "checkpoint-4"
            assert json.loads((Path(resume) / "trainer_state.json").read_text())["global_step"] == 4
            began = []
            trainer.add_callback(type("Began", (__import__("transformers").TrainerCallback,), {
                "on_step_begin": lambda self, args, state, control, **kw: began.append(state.global_step)}))
            trainer.train(resume_from_checkpoint=resume)
            assert began == [4, 5], "the Trainer went on from step 4, not from step 0"
        finally:
            callback.close()
    finally:
        torch.set_num_threads(threads)


def test_resume_from_checkpoint_true_when_the_newest_step_is_lost(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """``train(resume_from_checkpoint=True)`` with no ckptd call: the newest ``checkpoint-6`` names a step that
    never committed; building the Trainer warns and rewrites it to step 4, and the run trains on from step 4
    to the weights of the uninterrupted run."""
    import torch
    from transformers import TrainerCallback

    from ckptd.plugins.huggingface import CkptdCallback

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            first = _trainer(tmp_path / "out", callback, max_steps=6)
            first.train()
            expected = {name: tensor.detach().clone() for name, tensor in first.model.state_dict().items()}
        finally:
            callback.close()
        (tmp_path / "ckpt" / step_dir(6) / MANIFEST_NAME).unlink()

        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            with caplog.at_level(logging.WARNING, logger="ckptd.plugins"):
                trainer = _trainer(tmp_path / "out", callback, max_steps=6)
            (warning,) = [r.getMessage() for r in caplog.records if r.name == "ckptd.plugins"]
            pointer = tmp_path / "out" / "checkpoint-6"
            assert str(pointer) in warning and "points to ckptd step 6" in warning and "restoring step 4" in warning
            assert json.loads((pointer / "trainer_state.json").read_text())["global_step"] == 4
            began: list[int] = []

            class Began(TrainerCallback):
                def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                    began.append(state.global_step)

            trainer.add_callback(Began())
            trainer.train(resume_from_checkpoint=True)
            assert began == [4, 5], "the Trainer went on from step 4"
            weights = trainer.model.state_dict()
            different = [name for name, tensor in expected.items() if not torch.equal(weights[name], tensor)]
            assert not different, f"weights differ from the uninterrupted run: {different}"
        finally:
            callback.close()
    finally:
        torch.set_num_threads(threads)


def test_a_checkpoint_directory_left_half_written_is_made_whole_before_the_trainer_resumes(tmp_path: Path) -> None:
    """Killed while ``checkpoint-6`` was written (no marker, no weight index yet) and, in another run, before the
    RNG file: ``get_last_checkpoint`` returns that directory, so building the Trainer makes it whole from ckptd
    and ``train(resume_from_checkpoint=True)`` goes on from step 6."""
    import torch

    from ckptd.plugins.huggingface import CkptdCallback
    from ckptd.plugins.huggingface.trainer import MARKER_NAME

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            _trainer(tmp_path / "out", callback, max_steps=6).train()
        finally:
            callback.close()
        newest = tmp_path / "out" / "checkpoint-6"
        complete = sorted(path.name for path in newest.iterdir())
        for name in (MARKER_NAME, "model.safetensors.index.json", "rng_state.pth"):
            (newest / name).unlink()

        for damage, steps in (("half-written", 8), ("no RNG file", 10)):
            callback = CkptdCallback(tmp_path / "ckpt")
            try:
                trainer = _trainer(tmp_path / "out", callback, max_steps=steps)
                assert sorted(path.name for path in newest.iterdir()) == complete, damage
                trainer.train(resume_from_checkpoint=True)
                assert trainer.state.global_step == steps
            finally:
                callback.close()
            newest = tmp_path / "out" / f"checkpoint-{steps}"  # the next run's newest: its RNG file lost
            (newest / "rng_state.pth").unlink()
    finally:
        torch.set_num_threads(threads)
