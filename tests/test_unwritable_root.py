"""Local roots that cannot be written raise :class:`ckptd.errors.StorageError` (itself, not an ``OSError`` with the
StorageError only chained), naming the path and what to do, from ``CheckpointManager(...)`` or the first save.

The read-only cases are real: each runs in a child process inside its own mount namespace (``unshare
--mount``) where the directory is bind-mounted read-only, so every write fails with EROFS as on a disk
remounted read-only, and the mount ends with the child. That needs root (the usual CI container); a
non-root user gets the same directories with mode 0555 instead (EACCES), which root would ignore. Roots
that are a file, or lie under one, need neither."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import StorageError

#: Run in the child: open a manager on argv[1], save one step, wait; print what was raised as JSON.
_CHILD = """
import json, sys, torch, ckptd
from ckptd.errors import StorageError
outcome = {"raised": None}
try:
    with ckptd.CheckpointManager(sys.argv[1], capture_rng=False) as manager:
        outcome["opened"] = True
        if manager.committed_steps():
            live = {"w": torch.zeros(8)}
            outcome["restored"] = manager.restore(live)
        manager.save(5, {"w": torch.ones(8)}, force=True)
        manager.wait()
except BaseException as error:
    outcome.update(raised=type(error).__name__, storage_error=isinstance(error, StorageError),
                   os_error=isinstance(error, OSError), message=str(error),
                   path=getattr(error, "path", None), hint=getattr(error, "hint", None))
print(json.dumps(outcome))
"""


def _read_only_runner(directory: Path) -> list[str] | None:
    """The command prefix that runs a child with ``directory`` read-only, or None when neither way works here."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"], capture_output=True,
                           check=False, timeout=60)
    return [unshare, "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"',
            str(directory)] if probe.returncode == 0 else None


def _attempt(root: Path, prefix: list[str]) -> dict[str, object]:
    completed = subprocess.run([*prefix, sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True,
                               check=False, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _assert_storage_error(outcome: dict[str, object], path: Path) -> None:
    assert outcome["raised"] == "StorageError" and outcome["storage_error"] and not outcome["os_error"], outcome
    assert str(path) in str(outcome["message"]), outcome
    assert outcome["hint"], outcome


@pytest.fixture
def read_only(tmp_path: Path) -> tuple[Path, list[str]]:
    """A directory (holding a committed step 1, an empty directory and nothing else) and the prefix that runs
    a child with it read-only."""
    directory = tmp_path / "ro"
    directory.mkdir()
    with ckptd.CheckpointManager(directory / "used", capture_rng=False) as manager:
        manager.save(1, {"w": torch.zeros(8)}, force=True)
    (directory / "empty").mkdir()
    prefix = _read_only_runner(directory)
    if prefix is None:
        pytest.skip("no way to make a directory read-only here (root without unshare --mount)")
    yield directory, prefix
    directory.chmod(0o755)


def test_an_empty_read_only_root_raises_storage_error_naming_it(read_only: tuple[Path, list[str]]) -> None:
    directory, prefix = read_only
    outcome = _attempt(directory / "empty", prefix)
    _assert_storage_error(outcome, directory / "empty")
    assert "read-only" in str(outcome["hint"]) or "may not write" in str(outcome["hint"]), outcome


def test_a_root_under_a_read_only_parent_raises_storage_error(read_only: tuple[Path, list[str]]) -> None:
    directory, prefix = read_only
    outcome = _attempt(directory / "new" / "root", prefix)
    _assert_storage_error(outcome, directory / "new")
    assert not (directory / "new").exists()


def test_a_read_only_root_with_steps_restores_then_refuses_the_save(read_only: tuple[Path, list[str]]) -> None:
    directory, prefix = read_only
    outcome = _attempt(directory / "used", prefix)
    assert outcome["raised"] == "StorageError" and not outcome["os_error"], outcome
    if os.geteuid() == 0:  # EROFS: opened without the writer lock, restores, then the save fails
        assert outcome.get("opened") and outcome.get("restored") == 1, outcome
        assert "step 5" in str(outcome["message"]) or "read-only" in str(outcome["message"]), outcome
    assert str(directory / "used") in str(outcome["message"]), outcome
    with ckptd.CheckpointManager(directory / "used", capture_rng=False) as manager:
        assert manager.committed_steps() == [1], "the committed step is kept, nothing half-written is"


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_root_that_is_a_file_or_lies_under_one_raises_storage_error(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "ckpt"
    blocker.write_text("not a directory")
    root = blocker if where == "file" else blocker / "run1"
    with pytest.raises(StorageError) as caught:
        ckptd.CheckpointManager(root)
    assert not isinstance(caught.value, OSError)
    assert caught.value.path == str(root) and str(blocker) in str(caught.value)
    assert "not a directory" in str(caught.value) and "pass a directory" in str(caught.value)
