"""A full disk: saving into a filesystem without space fails with DiskFullError, commits nothing
partial, keeps the older steps restorable, and the manager saves normally once there is space."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.errors import DiskFullError
from ckptd.format.layout import TEMP_MARKER
from ckptd.policy import Policy
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory, mounted_tmpfs  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template
from harness.write_faults import DiskWithBudget
from ckptd.tiers import direct_io, local

SMALL, LARGE = 2 * 1024 * 1024, 12 * 1024 * 1024
KEEP_ONE = Policy(keep_local=1)


def use_disk(monkeypatch: pytest.MonkeyPatch, disk: DiskWithBudget) -> None:
    """Route the local tier's writes (buffered and direct) through ``disk``."""
    monkeypatch.setattr(local, "os", disk)
    monkeypatch.setattr(direct_io, "os", disk)


def check_only_step_committed(manager_factory: ManagerFactory, root: Path, step: int, nbytes: int) -> None:
    """A fresh manager on ``root`` lists only ``step``, restores its bytes, and no temporary is left."""
    manager = manager_factory(root, policy=KEEP_ONE)
    assert manager.committed_steps() == [step]
    assert list(root.glob(f"step-*/*{TEMP_MARKER}*")) == []
    live = synthetic_template(nbytes)
    assert manager.restore(live) == step
    assert_same_state(live, synthetic_state(step, nbytes))
    manager.close()


def save_fails_with_disk_full(manager_factory: ManagerFactory, root: Path, step: int, nbytes: int) -> None:
    manager = manager_factory(root, policy=KEEP_ONE)
    with pytest.raises(DiskFullError) as caught:
        manager.save(step, synthetic_state(step, nbytes), force=True)
        manager.wait()
    assert "disk full" in str(caught.value)
    manager.close()


def save_step(manager_factory: ManagerFactory, root: Path, step: int, nbytes: int) -> None:
    manager = manager_factory(root, policy=KEEP_ONE)
    assert manager.save(step, synthetic_state(step, nbytes), force=True)
    manager.wait()
    manager.close()


def test_saving_into_a_full_tmpfs_fails_cleanly(tmp_path: Path, manager_factory: ManagerFactory) -> None:
    root = tmp_path / "small-tmpfs"
    with mounted_tmpfs(root, "8m") as mounted:
        if not mounted:
            pytest.skip("no tmpfs can be mounted here; the patched-write test covers ENOSPC")
        save_step(manager_factory, root, 1, SMALL)
        save_fails_with_disk_full(manager_factory, root, 2, LARGE)
        check_only_step_committed(manager_factory, root, 1, SMALL)
        save_step(manager_factory, root, 3, SMALL)  # the failed step gave its space back
        check_only_step_committed(manager_factory, root, 3, SMALL)


def measure_step_writes(manager_factory: ManagerFactory, root: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Bytes the local tier writes to save step 2 (into a scratch directory)."""
    counter = DiskWithBudget(None)
    use_disk(monkeypatch, counter)
    save_step(manager_factory, root, 2, SMALL)
    monkeypatch.undo()
    assert counter.written > SMALL, "the local tier no longer writes through os.write/os.pwrite; update the test"
    return counter.written


#: Where the space runs out: a fraction of the bytes a save writes, or bytes short of all of them
#: (the manifest, a few hundred bytes, is written last; its size varies by a byte or two with its time).
BUDGETS = {"nothing": (0.0, 0), "in-data": (0.3, 0), "late-data": (0.9, 0), "in-manifest": (1.0, 100)}


@pytest.mark.parametrize("where", list(BUDGETS))
def test_disk_full_at_any_point_of_a_save_commits_nothing(checkpoint_dir: Path, tmp_path: Path, where: str,
                                                          manager_factory: ManagerFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the real write, when the space runs out before the first byte, in the data file or
    in the manifest."""
    total = measure_step_writes(manager_factory, tmp_path / "scratch", monkeypatch)
    save_step(manager_factory, checkpoint_dir, 1, SMALL)
    fraction, short = BUDGETS[where]
    use_disk(monkeypatch, DiskWithBudget(int(total * fraction) - short))
    save_fails_with_disk_full(manager_factory, checkpoint_dir, 2, SMALL)
    monkeypatch.undo()
    # the failed step gives its space back: neither its index nor its data file is left behind
    assert not tamper.index_path(checkpoint_dir, 2).exists()
    assert not list((checkpoint_dir / "step-000000000002").glob("rank-*"))
    check_only_step_committed(manager_factory, checkpoint_dir, 1, SMALL)
    save_step(manager_factory, checkpoint_dir, 2, SMALL)
    check_only_step_committed(manager_factory, checkpoint_dir, 2, SMALL)
