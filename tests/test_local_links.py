"""The local tier never follows a symbolic link below its root (fault matrix row 31): a step's file or
the step directory replaced by a link to an identical copy outside the root is refused, typed, and a
restore falls back to the step before it; a root that is itself a link works."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptd import CheckpointManager, Policy
from ckptd.errors import UnsafePathError
from ckptd.tiers.confined import confined_path
from ckptd.tiers.local import LocalTier


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32) + step}


def _two_steps(root: Path) -> None:
    with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
        for step in (1, 2):
            manager.save(step, _state(step), force=True)
            manager.wait()


def _restore(root: Path) -> tuple[int | None, dict[str, torch.Tensor]]:
    state = {"w": torch.zeros(1024)}
    with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
        return manager.restore(state), state


@pytest.mark.parametrize("what", ["data", "manifest", "directory"])
def test_a_link_out_of_the_root_is_refused_and_the_restore_falls_back(tmp_path: Path, what: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    _two_steps(root)
    tier = LocalTier(root)
    step_name = next(name for name in os.listdir(root) if name.endswith("2") and (root / name).is_dir())
    step = root / step_name
    shutil.copytree(step, outside)
    if what == "directory":
        shutil.rmtree(step)
        step.symlink_to(outside, target_is_directory=True)
        assert 2 not in tier.list_step_numbers() and tier.list_files(2) == []
    else:
        name = "manifest.json" if what == "manifest" else next(n for n in os.listdir(step) if ".data" in n)
        (step / name).unlink()
        (step / name).symlink_to(outside / name)
        with pytest.raises(UnsafePathError, match="symbolic link"):
            tier.read_bytes(f"{step_name}/{name}")
    restored, state = _restore(root)
    assert restored == 1 and torch.equal(state["w"], _state(1)["w"])


def test_a_root_that_is_a_link_restores(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    _two_steps(link)
    restored, state = _restore(link)
    assert restored == 2 and torch.equal(state["w"], _state(2)["w"])


def test_dot_dot_and_absolute_parts_are_refused(tmp_path: Path) -> None:
    for bad in ("../x", "a/../../x", "/etc/passwd"):
        with pytest.raises(UnsafePathError):
            confined_path(tmp_path, bad, tier="local test")
    assert confined_path(tmp_path, "a/b", tier="local test") == tmp_path / "a" / "b"
