"""The local tier's path confinement (ckptd.tiers.confined) on paths through a component that is a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.errors import StorageError
from ckptd.tiers.local import LocalTier


def test_a_path_below_a_regular_file_does_not_exist(tmp_path: Path) -> None:
    """Regression (found in review): the confinement check's ``lstat`` of ``file/name`` raised
    NotADirectoryError, so ``exists`` raised where it answered False before the check was added."""
    (tmp_path / "step-000000000001").write_bytes(b"a file where a step directory belongs")
    tier = LocalTier(str(tmp_path))
    assert tier.exists("step-000000000001/manifest.json") is False
    with pytest.raises(StorageError, match="Not a directory"):
        tier.read_bytes("step-000000000001/manifest.json")
