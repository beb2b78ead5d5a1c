"""``CkptdCallback(..., export_safetensors=True)``: ``checkpoint-N/model.safetensors`` (and ``config.json``) of
each committed step, written in the background through ckptd export's code, loads with ``from_pretrained`` to
the step's saved weights exactly; a save never waits for it.

In this process: a tiny GPT-2 built from a config (no download) trained 6 steps on CPU, a save every 2 steps.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from test_hf_trainer_pointer_fallback import _trainer  # the same tiny GPT-2 and Trainer

pytestmark = pytest.mark.integrations

_CONFIG = {"vocab_size": 64, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _saved_weights(callback: Any, step: int) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    fresh = GPT2LMHeadModel(GPT2Config(**_CONFIG))
    callback.manager.restore({"model": fresh}, step=step, keys=["model"])
    return fresh.state_dict()


def _assert_loads_as_saved(directory: Path, saved: dict[str, Any]) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(directory).state_dict()
    assert loaded.keys() == saved.keys()
    different = [name for name, tensor in saved.items() if not torch.equal(loaded[name], tensor)]
    assert not different, f"{directory.name}: {different}"


def test_model_safetensors_of_committed_steps_load_as_saved(tmp_path, one_thread):
    from ckptd.plugins.huggingface import CkptdCallback

    callback = CkptdCallback(tmp_path / "ckpt", export_safetensors=True)
    try:
        trainer = _trainer(tmp_path / "out", callback, 6)
        trainer.train()
        callback.wait()  # for the commits and their exports
        assert callback.manager.committed_steps() == [4, 6]
        directories = sorted((tmp_path / "out").glob("checkpoint-*"))
        assert [path.name for path in directories] == ["checkpoint-4", "checkpoint-6"]
        # step 6 is the newest: always exported (an older step is skipped when a newer one is queued)
        assert (tmp_path / "out" / "checkpoint-6" / "model.safetensors").is_file()
        exported = [path for path in directories if (path / "model.safetensors").is_file()]
        for directory in exported:
            step = int(directory.name.split("-")[1])
            assert not (directory / "model.safetensors.index.json").exists(), "the empty weight index stayed"
            _assert_loads_as_saved(directory, _saved_weights(callback, step))
        final = {name: tensor.detach() for name, tensor in trainer.model.state_dict().items()}
        _assert_loads_as_saved(tmp_path / "out" / "checkpoint-6", final)
        assert not list((tmp_path / "out").rglob(".ckptd-export*")), "an export directory stayed behind"
    finally:
        callback.close()


def test_a_save_does_not_wait_for_the_export(tmp_path, one_thread, monkeypatch):
    """The first export is held until the training has ended: every later save still happened."""
    import ckptd.plugins.huggingface.trainer as module
    from ckptd.plugins.huggingface import CkptdCallback

    release, started, finished = threading.Event(), [], []
    export_model = module.export_model

    def held_export(tiers: Any, step: int, directory: Path, model: Any, **options: Any) -> None:
        started.append(step)
        assert release.wait(timeout=300), "the test never released the export"
        export_model(tiers, step, directory, model, **options)
        finished.append(step)

    monkeypatch.setattr(module, "export_model", held_export)
    callback = CkptdCallback(tmp_path / "ckpt", export_safetensors=True)
    try:
        trainer = _trainer(tmp_path / "out", callback, 6)
        trainer.train()
        callback.manager.wait()
        assert started[:1] == [2] and finished == [], (started, finished)
        assert callback.manager.committed_steps() == [4, 6], "a save waited for the held export"
        assert trainer.state.global_step == 6
        release.set()
        callback.wait()
        assert finished and finished[-1] == 6, finished
        assert (tmp_path / "out" / "checkpoint-6" / "model.safetensors").is_file()
    finally:
        release.set()
        callback.close()
