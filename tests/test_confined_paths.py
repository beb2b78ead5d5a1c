"""The local tier's paths: confinement (ckptd.tiers.confined) through a component that is a file, and the
durable creation of an existing root (make_directory)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ckptd.errors import StorageError
from harness.write_faults import ErrnoRule, FaultyDisk
from ckptd.tiers.local import LocalTier


def test_a_path_below_a_regular_file_does_not_exist(tmp_path: Path) -> None:
    """Regression (found in review): the confinement check's ``lstat`` of ``file/name`` raised
    NotADirectoryError, so ``exists`` raised where it answered False before the check was added."""
    (tmp_path / "step-000000000001").write_bytes(b"a file where a step directory belongs")
    tier = LocalTier(str(tmp_path))
    assert tier.exists("step-000000000001/manifest.json") is False
    with pytest.raises(StorageError, match="Not a directory"):
        tier.read_bytes("step-000000000001/manifest.json")


@pytest.mark.parametrize("error", [errno.EACCES, errno.EINVAL])
def test_an_existing_root_opens_where_its_parent_cannot_be_fsynced(tmp_path: Path, error: int) -> None:
    """The fsync of an existing root's parent (it may have been made by a killed process) is best effort
    where it cannot be done at all (a parent this process may not read, a file system that cannot fsync
    a directory), so that a restore still opens the root; a write-back error (EIO) is not hidden."""
    root = tmp_path / "root"
    root.mkdir()
    with FaultyDisk(rules=[ErrnoRule("fsync", error, times=None)]) as disk:
        LocalTier(str(root))
    assert disk.injected, "the parent's fsync was attempted"
    with FaultyDisk(rules=[ErrnoRule("fsync", errno.EIO, times=None)]):
        with pytest.raises(StorageError, match="Input/output error"):
            LocalTier(str(root))
