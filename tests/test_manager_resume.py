"""Resumed training equals uninterrupted training, bit for bit: a child training process (torch data
and dropout, numpy noise, ``random`` jitter, AdamW) is killed with SIGKILL mid-run, a new process resumes
from the newest checkpoint, and its weights, optimizer state and every random draw equal those of a run
that never crashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.testing.compare import assert_same_state
from harness.crash import CrashInjector, KillAt
from harness.fixtures import crash_injector, memory_backed, memory_backed_dir  # noqa: F401
from harness.workloads import train

TOTAL_STEPS = 12


def run_training(crash_injector: CrashInjector, directory: Path, result_file: Path,
                 kill_at: KillAt | None = None) -> tuple[Any, dict[str, Any] | None]:
    """Train in a child; returns (the child's result, what it wrote to ``result_file`` if it finished)."""
    child = crash_injector.run(train, str(directory / "checkpoints"), TOTAL_STEPS, str(result_file), kill_at=kill_at)
    if kill_at is not None:
        assert child.killed, f"the training child was not killed at {kill_at}: {child.error}"
        return child, None
    assert child.error is None, child.error
    return child, torch.load(result_file, weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(crash_injector: CrashInjector, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with memory_backed(tmp_path_factory.mktemp("uninterrupted")) as root:
        child, result = run_training(crash_injector, root, root / "result.pt")
    assert child.value is None and result is not None
    return result


@pytest.mark.parametrize("kill_at, resumes_from", [(KillAt("manifest-commit", occurrence=5), 4),
                                                   (KillAt("committed", occurrence=8), 8)],
                         ids=["killed-while-committing-step-5", "killed-right-after-committing-step-8"])
def test_resumed_training_equals_uninterrupted_training(crash_injector: CrashInjector, memory_backed_dir: Path,
                                                        uninterrupted: dict[str, Any], kill_at: KillAt,
                                                        resumes_from: int) -> None:
    crashed, _ = run_training(crash_injector, memory_backed_dir, memory_backed_dir / "unused.pt", kill_at=kill_at)
    assert crashed.reports == list(range(1, kill_at.occurrence)), "the child reports each step it saw committed"
    resumed, result = run_training(crash_injector, memory_backed_dir, memory_backed_dir / "resumed.pt")
    assert resumed.value == resumes_from and result is not None
    later_draws = {step: draws for step, draws in uninterrupted["draws"].items() if step > resumes_from}
    assert sorted(result["draws"]) == sorted(later_draws)
    assert_same_state(result["draws"], later_draws)
    assert_same_state(result["after"], uninterrupted["after"])
    assert_same_state(result["model"], uninterrupted["model"])
    assert_same_state(result["optim"], uninterrupted["optim"])


def test_saving_the_restored_step_again_is_a_no_op(tmp_path) -> None:
    """nanoGPT saves at the top of an iteration, so right after a resume it asks to save the step it
    restored: that returns False and leaves the committed step as it was."""
    import torch

    import ckptd

    with ckptd.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, {"w": torch.full((8,), 3.0)}, force=True)
    committed = {path.name: path.read_bytes() for path in (tmp_path / "ckpt" / "step-000000000003").iterdir()}
    state = {"w": torch.zeros(8)}
    with ckptd.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore(state) == 3
        state["w"].add_(1.0)
        assert manager.save(3, state, force=True) is False
        assert manager.save(4, state, force=True) is True
    assert {path.name: path.read_bytes() for path in (tmp_path / "ckpt" / "step-000000000003").iterdir()} == committed
    fresh = {"w": torch.zeros(8)}
    with ckptd.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore(fresh) == 4
    assert torch.equal(fresh["w"], torch.full((8,), 4.0))
