"""Retention on the local tier: keep_local keeps the newest committed steps, never deletes the newest
one, and deletes nothing before the new step is committed (a failed save deletes nothing at all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.errors import CkptdError
from ckptd.format.layout import MANIFEST_NAME
from ckptd.policy import Policy
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template
from ckptd.tiers.local import LocalTier

NBYTES = 64 * 1024


def save(manager_factory: ManagerFactory, steps: range, keep_local: int | None) -> list[int]:
    manager = manager_factory(policy=Policy(keep_local=keep_local))
    for step in steps:
        assert manager.save(step, synthetic_state(step, NBYTES), force=True)
        manager.wait()
        assert manager.committed_steps()[-1] == step, "the newest committed step must be the one just saved"
    committed = manager.committed_steps()
    manager.close()
    return committed


@pytest.mark.parametrize("keep_local, kept", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (None, [1, 2, 3, 4, 5])])
def test_keep_local_keeps_the_newest_steps(manager_factory: ManagerFactory, checkpoint_dir: Path,
                                           keep_local: int | None, kept: list[int]) -> None:
    assert save(manager_factory, range(1, 6), keep_local) == kept
    on_disk = sorted(int(path.name.split("-")[1]) for path in checkpoint_dir.glob("step-*"))
    assert on_disk == kept
    reader = manager_factory(policy=Policy(keep_local=keep_local))
    for step in kept:
        live = synthetic_template(NBYTES)
        assert reader.restore(live, step=step) == step
        assert_same_state(live, synthetic_state(step, NBYTES))


def test_nothing_is_deleted_before_the_new_step_is_committed(manager_factory: ManagerFactory, checkpoint_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every deletion the local tier makes is observed (wrapping the real method): each happens while
    the newest saved step already has its manifest."""
    save(manager_factory, range(1, 3), keep_local=1)
    deletions: list[tuple[list[str], bool]] = []
    real_delete, new_manifest = LocalTier.delete_files, tamper.manifest_path(checkpoint_dir, 3)

    def observed_delete(tier: LocalTier, paths: list[str]) -> None:
        deletions.append((list(paths), new_manifest.exists()))
        real_delete(tier, paths)

    monkeypatch.setattr(LocalTier, "delete_files", observed_delete)
    save(manager_factory, range(3, 4), keep_local=1)
    assert deletions, "retention deleted nothing through LocalTier.delete_files; update the test"
    assert all(committed for _, committed in deletions), deletions
    assert any(path.endswith(MANIFEST_NAME) for paths, _ in deletions for path in paths)


def test_a_failed_save_deletes_no_older_step(manager_factory: ManagerFactory, checkpoint_dir: Path) -> None:
    save(manager_factory, range(1, 3), keep_local=1)
    manager = manager_factory(policy=Policy(keep_local=1))
    with pytest.raises(CkptdError):
        manager.save(3, {"refused": object()}, force=True)  # needs pickle: the save fails
        manager.wait()
    assert manager.committed_steps() == [2]
    live = synthetic_template(NBYTES)
    assert manager.restore(live) == 2
    assert_same_state(live, synthetic_state(2, NBYTES))


def test_an_uncommitted_newer_directory_does_not_count_as_newest(manager_factory: ManagerFactory,
                                                                 checkpoint_dir: Path) -> None:
    """A directory left by a crashed save of step 9 is not committed: it neither counts toward
    keep_local nor shields step 3, the newest committed step, from being restored."""
    save(manager_factory, range(1, 3), keep_local=1)
    leftover = tamper.data_path(checkpoint_dir, 9)
    leftover.parent.mkdir()
    leftover.write_bytes(b"half a data file")
    assert save(manager_factory, range(3, 4), keep_local=1) == [3]
    live = synthetic_template(NBYTES)
    assert manager_factory(policy=Policy(keep_local=1)).restore(live) == 3
    assert_same_state(live, synthetic_state(3, NBYTES))


class _Released:
    """A retention policy whose answer changes after the saves: steps are let go when the test says."""

    def __init__(self) -> None:
        self.released: set[int] = set()

    def deletable(self, committed: list[int]) -> list[int]:
        return [step for step in committed if step in self.released and step != max(committed)]


def test_a_step_let_go_after_the_last_commit_leaves_at_close(manager_factory: ManagerFactory,
                                                              checkpoint_dir: Path) -> None:
    """Lightning's save_top_k removes the older checkpoint after the newest is saved: no commit follows."""
    retention = _Released()
    manager = manager_factory(policy=Policy(keep_local=retention))
    for step in (1, 2, 3):
        manager.save(step, synthetic_state(step, NBYTES), force=True)
    manager.wait()
    retention.released.update({2, 3})  # 3 is the newest: kept whatever the policy says
    assert manager.committed_steps() == [1, 2, 3], "nothing is deleted before close"
    manager.close()
    assert sorted(int(path.name.split("-")[1]) for path in checkpoint_dir.glob("step-*")) == [1, 3]
    restored = synthetic_template(NBYTES)
    reader = manager_factory(policy=Policy(keep_local=None))
    assert reader.restore(restored) == 3
    assert_same_state(restored, synthetic_state(3, NBYTES))
