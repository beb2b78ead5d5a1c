"""A local root on a file system gone read-only (EROFS, e.g. remounted after errors): a restarted job can
still open a manager on it and restore (nobody writes through a read-only mount, so the writer lock is
skipped with a warning), and a save fails with a typed error naming the step, keeping every committed
step. The read-only file system is :class:`harness.write_faults.FaultyDisk` failing every call that
writes with EROFS (no root needed); the matrix's row 7 also remounts a real tmpfs as root."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ckptd.errors import StorageError
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template
from harness.write_faults import ErrnoRule, FaultyDisk

NBYTES = 256 * 1024
READ_ONLY = [ErrnoRule(operation, errno.EROFS, times=None) for operation in ("open", "write", "rename", "fsync")]


def test_a_read_only_root_restores_and_refuses_saves(checkpoint_dir: Path, manager_factory: ManagerFactory,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    manager = manager_factory(checkpoint_dir)
    manager.save(1, synthetic_state(1, NBYTES), force=True)
    manager.close()
    with FaultyDisk(rules=READ_ONLY) as disk:
        manager = manager_factory(checkpoint_dir)
        live = synthetic_template(NBYTES)
        assert manager.restore(live) == 1
        assert_same_state(live, synthetic_state(1, NBYTES))
        with pytest.raises(StorageError) as caught:
            manager.save(2, synthetic_state(2, NBYTES), force=True)
            manager.wait()
        manager.close()
    assert disk.injected
    assert caught.value.step == 2 and "read-only" in str(caught.value), caught.value
    assert "read-only file system: opened without the writer lock" in caplog.text
    assert manager_factory(checkpoint_dir).committed_steps() == [1]
