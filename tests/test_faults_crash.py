"""Crashes during save: a child process saving a real state is killed with SIGKILL, at random moments
and at each phase of a save. After every kill, restarting finds only whole steps committed, restores
the previous step or the new one, returns exactly the bytes saved at that step, and removes the
temporary files the crash left behind."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.format.layout import TEMP_MARKER
from ckptd.policy import Policy
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.crash import ChildResult, CrashInjector, KillAt
from harness.fixtures import (ManagerFactory, checkpoint_dir, crash_injector, manager_factory,  # noqa: F401
                                    memory_backed_dir)
from harness.workloads import save_steps, synthetic_state, synthetic_template

BIG_STATE = 100 * 1024 * 1024
RANDOM_KILLS = 22
SMALL_STATE = 1024 * 1024
SMALL_CHUNKS = {"chunk_bytes": 64 * 1024}


def temporaries(root: Path) -> list[Path]:
    return sorted(root.glob(f"step-*/*{TEMP_MARKER}*"))


def check_restart(manager_factory: ManagerFactory, root: Path, nbytes: int, previous: int, attempted: int,
                  child: ChildResult) -> int:
    """Restart on ``root`` after a killed save of ``attempted``; check it and return the step restored."""
    assert child.killed, f"the child was not killed: exit code {child.exitcode}, error {child.error}"
    manager = manager_factory(root, policy=Policy(keep_local=1))
    try:
        assert temporaries(root) == [], "temporary files of the crash were not removed on restart"
        committed = manager.committed_steps()
        assert committed and set(committed) <= {previous, attempted}, f"committed {committed}"
        live = synthetic_template(nbytes)
        restored = manager.restore(live)
        assert restored is not None and restored == max(committed)
        assert_same_state(live, synthetic_state(restored, nbytes))
        if attempted in dict(child.reports):  # the child saw the step committed: it must survive the crash
            assert restored == attempted
        for step in committed[:-1]:  # every listed step is whole: it restores and has the bytes saved
            assert manager.restore(live, step=step) == step
            assert_same_state(live, synthetic_state(step, nbytes))
    finally:
        manager.close()
    return restored


def test_sigkill_at_random_moments_of_a_100mb_save(crash_injector: CrashInjector, manager_factory: ManagerFactory,
                                                    memory_backed_dir: Path) -> None:
    root = str(memory_backed_dir)
    calibration = crash_injector.run(save_steps, root, 1, 2, BIG_STATE)
    assert calibration.error is None and [step for step, _ in calibration.reports] == [1, 2], calibration.error
    save_seconds = min(calibration.value)  # kills land within the fastest save seen so far
    seed = int.from_bytes(os.urandom(4), "little")
    moments = random.Random(seed)
    previous, cut_mid_save = 2, 0
    for kill in range(RANDOM_KILLS):
        attempted, delay = previous + 1, moments.uniform(0.0, save_seconds)
        child = crash_injector.run(save_steps, root, attempted, 1, BIG_STATE, hold=True, kill_after_s=delay)
        context = f"seed {seed}, kill {kill}, {delay:.3f} s into a {save_seconds:.3f} s save"
        finished = dict(child.reports)
        cut_mid_save += attempted not in finished
        save_seconds = min([save_seconds, *finished.values()])
        try:
            previous = check_restart(manager_factory, memory_backed_dir, BIG_STATE, previous, attempted, child)
        except AssertionError as error:
            raise AssertionError(f"{context}: {error}") from error
    assert cut_mid_save >= RANDOM_KILLS // 2, f"only {cut_mid_save} of {RANDOM_KILLS} kills cut a save (seed {seed})"


PHASE_OUTCOMES = {  # phase -> (step restored after the kill, whether the kill leaves temporary files)
    KillAt("data-write", occurrence=3): (1, True),
    KillAt("data-commit"): (1, True),
    KillAt("index-commit"): (1, True),
    KillAt("manifest-commit"): (1, True),
    KillAt("committed"): (2, False),
    KillAt("retention"): (2, False),
}


@pytest.mark.parametrize("kill_at", list(PHASE_OUTCOMES), ids=lambda kill_at: kill_at.phase)
def test_sigkill_at_each_phase_of_a_save(crash_injector: CrashInjector, manager_factory: ManagerFactory,
                                         checkpoint_dir: Path, kill_at: KillAt) -> None:
    expected_step, leaves_temporaries = PHASE_OUTCOMES[kill_at]
    with override(**SMALL_CHUNKS):
        first = manager_factory(policy=Policy(keep_local=1))
        first.save(1, synthetic_state(1, SMALL_STATE), force=True)
        first.close()
    child = crash_injector.run(save_steps, str(checkpoint_dir), 2, 1, SMALL_STATE, settings=SMALL_CHUNKS,
                               kill_at=kill_at)
    assert bool(temporaries(checkpoint_dir)) == leaves_temporaries
    assert check_restart(manager_factory, checkpoint_dir, SMALL_STATE, 1, 2, child) == expected_step


def test_a_step_half_deleted_by_a_crash_is_not_listed_and_is_cleaned_up(
        crash_injector: CrashInjector, manager_factory: ManagerFactory, checkpoint_dir: Path) -> None:
    crash_injector.run(save_steps, str(checkpoint_dir), 1, 1, SMALL_STATE)
    child = crash_injector.run(save_steps, str(checkpoint_dir), 2, 1, SMALL_STATE, kill_at=KillAt("retention"))
    assert child.killed
    assert tamper.data_path(checkpoint_dir, 1).exists() and not tamper.manifest_path(checkpoint_dir, 1).exists()
    manager = manager_factory(policy=Policy(keep_local=1))
    assert manager.committed_steps() == [2]
    manager.save(3, synthetic_state(3, SMALL_STATE), force=True)
    manager.wait()
    assert manager.committed_steps() == [3]
    assert not tamper.step_path(checkpoint_dir, 1).exists()


def test_crash_injector_kills_only_at_the_phase_asked_for(crash_injector: CrashInjector,
                                                          checkpoint_dir: Path) -> None:
    """Without old steps to delete, a save never reaches ``retention``: the child must end normally."""
    child = crash_injector.run(save_steps, str(checkpoint_dir), 1, 1, SMALL_STATE, keep_local=None,
                               kill_at=KillAt("retention"))
    assert not child.killed and child.exitcode == 0 and child.error is None
    assert [step for step, _ in child.reports] == [1]
    with pytest.raises(ValueError, match="unknown phase"):
        KillAt("between-the-chunks")
