"""fsync returning EIO (fault matrix row 5): after a writeback error the page cache state is unknown
(Linux drops the dirty pages and a second fsync "succeeds": the fsyncgate lesson), so a save whose fsync
failed fails with a typed error naming the file, step and tier, commits nothing, is never retried and
then trusted, leaves the previous step restorable bit for bit, and the next save works.

The errors come from the real file layer's system calls, failed with an errno by
:class:`harness.write_faults.FaultyDisk` (no root needed); the injected fsync EIO also zeroes the
file's unsynced bytes, so a retry-then-trust would restore wrong bytes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ckptd.errors import StorageError
from ckptd.format.layout import TEMP_MARKER, step_dir
from ckptd.policy import Policy
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.write_faults import ErrnoRule, FaultyDisk
from harness.workloads import synthetic_state, synthetic_template

NBYTES = 1024 * 1024

#: Where the fsync fails: a data file, the rank's index, the manifest, the step directory.
WHERE = {"data": "rank-00000.data", "index": "rank-00000.index.json", "manifest": "manifest.json",
         "directory": "."}


def _save(manager_factory: ManagerFactory, root: Path, step: int) -> None:
    manager = manager_factory(root, policy=Policy(keep_local=1))
    assert manager.save(step, synthetic_state(step, NBYTES), force=True)
    manager.wait()
    manager.close()


def _only_committed(manager_factory: ManagerFactory, root: Path, step: int) -> None:
    manager = manager_factory(root)
    assert manager.committed_steps() == [step]
    live = synthetic_template(NBYTES)
    assert manager.restore(live) == step
    assert_same_state(live, synthetic_state(step, NBYTES))
    manager.close()


@pytest.mark.parametrize("where", list(WHERE))
def test_fsync_eio_fails_the_save_commits_nothing_and_the_next_save_works(
        where: str, checkpoint_dir: Path, manager_factory: ManagerFactory) -> None:
    _save(manager_factory, checkpoint_dir, 1)
    rule = ErrnoRule("fsync", errno.EIO, step=2, name=WHERE[where])
    manager = manager_factory(checkpoint_dir, policy=Policy(keep_local=1))
    with FaultyDisk(rules=[rule]) as disk, pytest.raises(StorageError) as caught:
        manager.save(2, synthetic_state(2, NBYTES), force=True)
        manager.wait()
    manager.close()
    assert disk.injected, "the fsync to fail was never called: the test no longer reaches it"
    text = str(caught.value)
    assert caught.value.step == 2 and caught.value.tier == "local", text
    assert "fsync" in text and "Input/output error" in text, text
    assert step_dir(2) in text and (where == "directory" or WHERE[where] in text), text
    # nothing of step 2 is committed or left behind; step 1 (kept: retention waits for a commit) restores
    assert not (checkpoint_dir / step_dir(2) / "manifest.json").exists()
    assert list(checkpoint_dir.glob(f"{step_dir(2)}/*")) == []
    _only_committed(manager_factory, checkpoint_dir, 1)
    _save(manager_factory, checkpoint_dir, 3)
    _only_committed(manager_factory, checkpoint_dir, 3)


def test_the_failed_fsync_is_not_retried(checkpoint_dir: Path, manager_factory: ManagerFactory) -> None:
    """Only the first fsync of the data file fails: a retry would succeed and commit zeroed bytes."""
    rule = ErrnoRule("fsync", errno.EIO, step=1, name="rank-00000.data", times=1)
    manager = manager_factory(checkpoint_dir)
    with FaultyDisk(rules=[rule]) as disk, pytest.raises(StorageError):
        manager.save(1, synthetic_state(1, NBYTES), force=True)
        manager.wait()
    assert len(disk.injected) == 1
    assert manager.committed_steps() == []
    assert not list(checkpoint_dir.glob(f"*/*{TEMP_MARKER}*"))


@pytest.mark.slow
def test_fsync_eio_on_one_rank_fails_the_step_on_every_rank(tmp_path: Path) -> None:
    """Out of the default run: fault-matrix row 18 runs the same two gloo ranks by default (an EIO on rank
    1's data write) and draws a write or an fsync in its long mode; the fsync EIO itself is checked on one
    rank above."""
    from ckptd.testing.multirank import run_multirank
    from harness.rank_faults import save_through_a_fault

    rule = ErrnoRule("fsync", errno.EIO, step=2, name="rank-00001.data")
    outcomes = run_multirank(save_through_a_fault, 2, str(tmp_path / "ckpt"), 1, rule, NBYTES, timeout_s=90)
    assert outcomes[1]["injected"] == 1
    for rank, outcome in enumerate(outcomes):
        assert "step 2" in outcome["failure"] and "rank 1" in outcome["failure"], (rank, outcome)
        assert "fsync" in outcome["failure"], (rank, outcome)
        assert outcome["after_failure"] == [1], (rank, outcome)  # nothing committed, step 1 kept
        assert outcome["committed"] == [3] and outcome["restored"] == 3, (rank, outcome)
        assert outcome["differences"] == [], (rank, outcome)
