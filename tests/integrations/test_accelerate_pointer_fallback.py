"""accelerate: an output directory whose ``ckptd-step.json`` names a step that never committed (the process died
before the commit) restores the previous committed step with the warning every integration gives, and never
starts from step 0 without saying so.

Real accelerate (CPU), real saves: step 4 through ckptd's ``accelerator.save_state`` (the directory holds only
``ckptd-step.json``), step 8 through accelerate's own ``save_state`` with ckptd's pre-hook (accelerate's pickled
files next to the marker); the lost step is one whose commit marker never reached the disk (its manifest
removed, as a kill between the data files and the commit leaves it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import NotFoundError, PickleRefusedError
from ckptd.format.layout import MANIFEST_NAME, step_dir


class _Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def _job(local: Path, *, allow_pickle: bool = False) -> tuple[Any, Any, torch.nn.Module, _Progress]:
    from accelerate import Accelerator

    from ckptd.plugins.huggingface import CkptdAccelerate

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    hooks = CkptdAccelerate(accelerator, local, step=lambda: progress.step, allow_pickle=allow_pickle)
    return accelerator, hooks, model, progress


@pytest.fixture
def lost_newest(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Steps 4 and 8 saved (into out/step-4 through ckptd's save_state, out/step-8 through accelerate's own);
    step 8's commit lost. Returns tmp_path and each step's weights."""
    accelerator, hooks, model, progress = _job(tmp_path / "ckpt")
    weights = {}
    for step in (4, 8):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(float(step))
        progress.step = step
        save_state = accelerator.save_state if step == 4 else type(accelerator).save_state.__get__(accelerator)
        save_state(str(tmp_path / "out" / f"step-{step}"))
        weights[step] = {key: value.clone() for key, value in model.state_dict().items()}
        hooks.manager.wait()
    hooks.close()
    assert sorted(path.name for path in (tmp_path / "out" / "step-4").iterdir()) == ["ckptd-step.json"]
    assert (tmp_path / "out" / "step-8" / "optimizer.bin").is_file()
    (tmp_path / "ckpt" / step_dir(8) / MANIFEST_NAME).unlink()
    return tmp_path, weights


def test_a_pointer_to_a_lost_step_warns_and_restores_the_previous_committed_step(
        lost_newest: tuple[Path, dict[int, dict[str, torch.Tensor]]], caplog: pytest.LogCaptureFixture) -> None:
    root, weights = lost_newest
    accelerator, hooks, model, progress = _job(root / "ckpt")
    pointer = root / "out" / "step-8"
    with caplog.at_level(logging.WARNING, logger="ckptd.plugins"):
        assert hooks.restore(str(pointer)) == 4
    warnings = [record.getMessage() for record in caplog.records if record.name == "ckptd.plugins"]
    assert len(warnings) == 1, warnings
    assert str(pointer / "ckptd-step.json") in warnings[0] and "points to ckptd step 8" in warnings[0]
    assert "restoring step 4" in warnings[0] and "training resumes from step 4" in warnings[0]
    assert progress.step == 4, "restarted from the previous committed step, not from 0"
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[4][key]), key
    assert hooks.restore(str(root / "out" / "step-4")) == 4
    hooks.close()


def test_load_state_of_a_marker_only_directory_falls_back_as_restore_does(
        lost_newest: tuple[Path, dict[int, dict[str, torch.Tensor]]], caplog: pytest.LogCaptureFixture) -> None:
    root, weights = lost_newest
    marker_only = root / "out" / "marker-8"
    marker_only.mkdir()
    (marker_only / "ckptd-step.json").write_bytes((root / "out" / "step-8" / "ckptd-step.json").read_bytes())
    accelerator, hooks, model, progress = _job(root / "ckpt")
    with caplog.at_level(logging.WARNING, logger="ckptd.plugins"):
        accelerator.load_state(str(marker_only))  # nothing of accelerate's there: nothing unpickled
    warnings = [record.getMessage() for record in caplog.records if record.name == "ckptd.plugins"]
    assert len(warnings) == 1 and "points to ckptd step 8" in warnings[0] and "restoring step 4" in warnings[0]
    assert progress.step == 4
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[4][key]), key
    hooks.close()


def test_a_lost_step_asked_for_by_number_or_through_load_state_of_accelerates_files_is_an_error(
        lost_newest: tuple[Path, dict[int, dict[str, torch.Tensor]]]) -> None:
    root, _ = lost_newest
    pointer = str(root / "out" / "step-8")
    accelerator, hooks, _, progress = _job(root / "ckpt")
    with pytest.raises(NotFoundError):
        hooks.restore(8)
    with pytest.raises(PickleRefusedError, match="restore"):  # refused before anything is read
        accelerator.load_state(pointer)
    hooks.close()
    accelerator, hooks, _, progress = _job(root / "ckpt", allow_pickle=True)
    with pytest.raises(NotFoundError) as caught:  # accelerate's own files there are step 8's: no fallback under them
        accelerator.load_state(pointer)
    assert "load_state" in str(caught.value) and f"CkptdAccelerate.restore({pointer!r})" in str(caught.value)
    assert progress.step == 0
    hooks.close()


def test_a_pointer_with_no_older_committed_step_raises(tmp_path: Path,
                                                       lost_newest: tuple[Path, dict[int, dict[str, torch.Tensor]]]
                                                       ) -> None:
    root, _ = lost_newest
    (root / "ckpt" / step_dir(4) / MANIFEST_NAME).unlink()
    accelerator, hooks, _, progress = _job(root / "ckpt")
    with pytest.raises(NotFoundError, match="no tier holds intact") as caught:
        hooks.restore(str(root / "out" / "step-8"))
    assert caught.value.step == 8 and progress.step == 0
    with pytest.raises(NotFoundError, match="holds no ckptd-step.json"):
        hooks.restore(str(tmp_path / "nowhere"))
    hooks.close()
