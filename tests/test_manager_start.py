"""A CheckpointManager that fails to start leaves nothing behind: no writer thread, no directory lock."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import ckptd
from ckptd.errors import PluginError


def _ckptd_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith("ckptd-")}


def test_a_manager_whose_remote_cannot_be_opened_releases_its_lock_and_threads(tmp_path: Path) -> None:
    before = _ckptd_threads()
    with pytest.raises(PluginError):
        ckptd.CheckpointManager(tmp_path, remote="nosuchscheme://bucket/run")
    assert _ckptd_threads() <= before
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:  # the lock was released
        assert manager.committed_steps() == []
