"""pytest fixtures for ckptd tests. Import the ones a test module uses by name::

    from harness.fixtures import crash_injector, manager_factory  # noqa: F401
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness.crash import CrashInjector

#: Opens a CheckpointManager: ``factory(directory=None, **options)``; closed when the test ends.
ManagerFactory = Callable[..., CheckpointManager]


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    """A fresh directory for one test's checkpoints."""
    return tmp_path / "checkpoints"


@pytest.fixture
def manager_factory(checkpoint_dir: Path) -> Iterator[ManagerFactory]:
    """Opens managers (default: on ``checkpoint_dir``, keep everything, no RNG capture) and closes
    them at the end of the test."""
    opened: list[CheckpointManager] = []

    def factory(directory: Path | None = None, **options: Any) -> CheckpointManager:
        options.setdefault("policy", Policy(keep_local=None))
        options.setdefault("capture_rng", False)
        manager = CheckpointManager(directory or checkpoint_dir, **options)
        opened.append(manager)
        return manager

    yield factory
    for manager in opened:
        manager.close()


@pytest.fixture(scope="session")
def crash_injector() -> CrashInjector:
    """One crash injector (and its forkserver) for the whole session."""
    return CrashInjector()


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[bool]:
    """Mount a size-limited tmpfs on ``mount_point`` (created if needed) for the block; yields whether
    the mount worked (it needs root and a sandbox that allows it), and unmounts at the end."""
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                 capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True, timeout=30)


@contextlib.contextmanager
def memory_backed(parent: Path) -> Iterator[Path]:
    """A directory on a tmpfs when one can be mounted, else on the disk of ``parent``. A process crash
    (SIGKILL) leaves a tmpfs exactly as it leaves a disk (both go through the page cache), so crash
    tests use it to stay fast: fsync costs nothing there."""
    with mounted_tmpfs(parent / "tmpfs", "1g"):
        yield parent / "tmpfs"


@pytest.fixture
def memory_backed_dir(tmp_path: Path) -> Iterator[Path]:
    """:func:`memory_backed` for one test."""
    with memory_backed(tmp_path) as directory:
        yield directory
