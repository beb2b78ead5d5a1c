"""The read-ahead before a restore reads the step's manifest and index through the restore's own reader
(each file is read once), but it is best effort: a failure it meets is not remembered and does not leave
the tier out, so the restore reads the file again and succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import StorageError, TierUnreachableError
from ckptd.manager.restoring import TierListings, restore_state
from ckptd.promotion.pull import prefetch_step
from ckptd.tiers.local import LocalTier


class _FailsFirstIndexRead(LocalTier):
    """A local tier whose first read of a rank index fails (a burst of 5xx, or a store gone for a moment)."""

    def __init__(self, root: Path, error: Exception) -> None:
        super().__init__(root)
        self.error: Exception | None = error
        self.index_reads = 0

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if path.endswith(".index.json"):
            self.index_reads += 1
            if self.error is not None:
                error, self.error = self.error, None
                raise error
        return super().read_bytes(path, offset, length)


@pytest.mark.parametrize("error", [StorageError("injected: 5xx past the retry budget"),
                                   TierUnreachableError("injected: the store did not answer")],
                         ids=["storage-error", "unreachable"])
def test_a_failure_during_the_read_ahead_does_not_fail_the_restore(tmp_path: Path, error: Exception) -> None:
    saved = {"weights": torch.randn(1000), "step": 3}
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(3, saved)
    tier = _FailsFirstIndexRead(tmp_path / "ckpt", error)
    listings = TierListings([tier])
    assert prefetch_step(tier, 3, 0, metadata=listings.metadata) == 0  # type: ignore[arg-type]
    assert not listings.failed, "the read-ahead's failure left the tier out of the restore"
    target = {"weights": torch.zeros(1000), "step": 0}
    result = restore_state([tier], target, rank=0, world_size=1, listings=listings, restore_rng=False)
    assert result.step == 3 and torch.equal(target["weights"], saved["weights"]) and target["step"] == 3
    assert tier.index_reads == 2, "the restore read the index again after the read-ahead's failure"


def test_the_read_ahead_and_the_restore_read_the_index_once(tmp_path: Path) -> None:
    saved = {"weights": torch.randn(1000)}
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(2, saved)
    tier = _FailsFirstIndexRead(tmp_path / "ckpt", RuntimeError("unused"))
    tier.error = None
    listings = TierListings([tier])
    prefetch_step(tier, 2, 0, metadata=listings.metadata)  # type: ignore[arg-type]
    target = {"weights": torch.zeros(1000)}
    assert restore_state([tier], target, rank=0, world_size=1, listings=listings, restore_rng=False).step == 2
    assert torch.equal(target["weights"], saved["weights"]) and tier.index_reads == 1
