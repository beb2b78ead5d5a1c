"""What CkptdCallback saves for a step equals what the Trainer's own checkpoint of that step holds.

Two identical runs in this process (the Trainer seeds every generator at construction): one with the
Trainer's default checkpointing, one with CkptdCallback taking its save requests. For step 4 (saved once
the Trainer logged the step, as it saves its own), ckptd's step must hold the same trainer state (global
step, log history), RNG states and model weights as the Trainer's ``checkpoint-4``, and the Trainer must
have written no checkpoint directory in the ckptd run. A third run with ``trainer_checkpoints=True`` keeps
both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integrations


def _train(output_dir: Path, callbacks: list[Any], resuming: bool = False, **arguments: Any) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ckptd.plugins.huggingface import ckptd_resume

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, index: int) -> dict[str, Any]:
            ids = torch.arange(16, dtype=torch.long).add_(index).remainder_(64)
            return {"input_ids": ids, "labels": ids.clone()}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    arguments = {"save_strategy": "steps", "save_steps": 4, "max_steps": 6, **arguments}
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=2, seed=7, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, **arguments)
    evaluation = Samples() if arguments.get("eval_strategy") else None
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), eval_dataset=evaluation, callbacks=callbacks)
    resume = ckptd_resume(trainer) if callbacks and resuming else None
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_step_ckptd_saves_is_the_checkpoint_the_trainer_writes(tmp_path, one_thread):
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_pt_utils import safe_globals

    from ckptd.plugins.huggingface import CkptdCallback
    from ckptd.plugins.huggingface.random_states import RandomStates

    _train(tmp_path / "plain", [])
    theirs = tmp_path / "plain" / "checkpoint-4"
    callback = CkptdCallback(tmp_path / "ckpt")
    _train(tmp_path / "ours", [callback])
    try:
        assert callback.manager.committed_steps() == [4, 6]
        directory = tmp_path / "ours" / "checkpoint-4"  # ckptd's: the Trainer's state and RNG files, no weights
        assert not list((tmp_path / "ours").glob("checkpoint-*/*.pt")), "the Trainer wrote its own checkpoint"
        assert json.loads((directory / "trainer_state.json").read_text()) == \
            json.loads((theirs / "trainer_state.json").read_text())
        saved: dict[str, Any] = {"trainer_state": None, "rng": RandomStates()}
        callback.manager.restore(saved, step=4, keys=["trainer_state", "rng"])
        assert json.loads(saved["trainer_state"]) == json.loads((theirs / "trainer_state.json").read_text())
        their_rng = torch.load(theirs / "rng_state.pth", weights_only=False)
        ours = saved["rng"].saved
        assert torch.equal(ours["cpu"], their_rng["cpu"])
        assert ours["python"] == their_rng["python"]
        assert ours["numpy"][0] == their_rng["numpy"][0] and (ours["numpy"][1] == their_rng["numpy"][1]).all()
        assert ours["numpy"][2:] == tuple(their_rng["numpy"][2:])
        with safe_globals():  # as the Trainer loads it
            mine = torch.load(directory / "rng_state.pth", weights_only=True)
        assert torch.equal(mine["cpu"], their_rng["cpu"]) and mine["python"] == their_rng["python"]
        assert mine["numpy"][0] == their_rng["numpy"][0] and (mine["numpy"][1] == their_rng["numpy"][1]).all()
        assert tuple(mine["numpy"][2:]) == tuple(their_rng["numpy"][2:])
        fresh = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
        callback.manager.restore({"model": fresh}, step=4, keys=["model"])
        restored = fresh.state_dict()
        weights = load_file(theirs / "model.safetensors")
        different = [name for name, tensor in weights.items() if not torch.equal(restored[name], tensor)]
        assert not different, different
    finally:
        callback.close()


def test_trainer_checkpoints_true_keeps_the_trainers_own_as_well(tmp_path, one_thread):
    from ckptd.plugins.huggingface import CkptdCallback

    callback = CkptdCallback(tmp_path / "ckpt", trainer_checkpoints=True)
    try:
        _train(tmp_path / "both", [callback])
        assert sorted(path.name for path in (tmp_path / "both").glob("checkpoint-*")) == ["checkpoint-4",
                                                                                        "checkpoint-6"]
        callback.manager.wait()
        assert callback.manager.committed_steps() == [4, 6]
    finally:
        callback.close()


def _weights(trainer: Any) -> dict[str, Any]:
    return {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}


def test_save_total_limit_is_what_the_local_tier_keeps(tmp_path, one_thread):
    from ckptd.plugins.huggingface import CkptdCallback

    callback = CkptdCallback(tmp_path / "ckpt")
    try:
        _train(tmp_path / "out", [callback], save_steps=2, save_total_limit=1)
        callback.manager.wait()
        assert callback.manager.committed_steps() == [6]
    finally:
        callback.close()


def test_load_best_model_at_end_loads_the_best_step_as_without_ckptd(tmp_path, one_thread):
    """The best step is the first evaluation (``greater_is_better`` on the loss, which falls): the final
    model must be step 2's, as the plain Trainer leaves it, not the last step's."""
    import torch

    from ckptd.plugins.huggingface import CkptdCallback

    best = {"save_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
            "metric_for_best_model": "loss", "greater_is_better": True}
    plain = _train(tmp_path / "plain", [], **best)
    assert plain.state.best_global_step == 2
    callback = CkptdCallback(tmp_path / "ckpt")
    try:
        ours = _train(tmp_path / "ours", [callback], **best)
        assert ours.state.best_global_step == 2 and ours.state.best_model_checkpoint is not None
        expected, weights = _weights(plain), _weights(ours)
        assert not [name for name in expected if not torch.equal(weights[name], expected[name])]
        callback.manager.wait()
        assert callback.manager.committed_steps() == [4, 6]  # every save also went through ckptd
    finally:
        callback.close()


def test_checkpoint_directories_follow_the_local_retention_and_hold_nothing_large(tmp_path, one_thread):
    """A fresh run to step 2, resumed (ckptd_resume) to 4, resumed again to 6; a save every 2 steps and
    ``save_total_limit=2``: ``output_dir`` holds ckptd's directories of the two steps the local tier keeps,
    none of them weights, optimizer or scheduler, and no resume directory of earlier ckptd versions."""
    from ckptd.plugins.huggingface import CkptdCallback

    (tmp_path / "out" / "ckptd-resume" / "checkpoint-2").mkdir(parents=True)  # an earlier version's leftover
    for max_steps in (2, 4, 6):
        callback = CkptdCallback(tmp_path / "ckpt")
        try:
            _train(tmp_path / "out", [callback], resuming=True, save_steps=2, save_total_limit=2,
                   max_steps=max_steps)
        finally:
            callback.close()
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    for directory in (tmp_path / "out").iterdir():
        sizes = {path.name: path.stat().st_size for path in directory.iterdir()}
        assert sorted(sizes) == ["ckptd-weights-are-in-ckptd.safetensors", "ckptd.json",
                                 "model.safetensors.index.json", "rng_state.pth", "trainer_state.json"], sizes
        assert max(sizes.values()) < 20_000, sizes
