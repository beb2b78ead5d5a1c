"""Fault-matrix rows of process crashes around a save and of tiers that disagree: 1, 2, 3, 13, 16, 21, 22.

Every crash is a real SIGKILL of a child process that saves through the real local tier
(:mod:`ckptd.testing.crash`: at a named phase of the save, or after a random delay); the restart that
follows is a fresh process opening a :class:`~ckptd.CheckpointManager` on the same root, as a restarted
job does. States are pure functions of their step (:class:`~ckptd.testing.invariants.SyntheticWorkload`),
so every check compares the restored bytes with the bytes that were saved.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.config import override
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.testing import invariants as inv
from ckptd.testing.crash import ChildResult, KillAt
from ckptd.testing.matrix import Outcome, RunContext, crash_injector, row
from ckptd.testing.workloads import save_steps, synthetic_state

SMALL = inv.SyntheticWorkload(1024 * 1024)
#: 64 KiB chunks: a 1 MiB save writes its data file in 16 pieces, each a ``data-write`` kill point.
SMALL_CHUNKS = {"chunk_bytes": 64 * 1024}
DATA_WRITES = 16
#: A save of this size takes tens of milliseconds on this machine: random delays land inside it.
TIMED = inv.SyntheticWorkload(16 * 1024 * 1024)
TIMED_WINDOW_S = 0.08


def _commit_first_step(root: Path, workload: inv.SyntheticWorkload, steps: tuple[int, ...] = (1,)) -> None:
    with override(**SMALL_CHUNKS), CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False,
                                                     daemon="off") as manager:
        for step in steps:
            manager.save(step, synthetic_state(step, workload.nbytes), force=True)
            manager.wait()


def _killed(child: ChildResult) -> inv.Check | None:
    if child.killed:
        return None
    return inv.Check("L3", False, f"the child was not killed (exit {child.exitcode}, error {child.error})")


def _after_crash(ctx: RunContext, root: Path, workload: inv.SyntheticWorkload, before: inv.CommittedRecord,
                 child: ChildResult, *, attempted: int, allowed: set[int], keep_last: int | None) -> Outcome:
    """The restart after a killed save of ``attempted``: a fresh process restores the newest step (which
    must be one of ``allowed``, and ``attempted`` when the child saw it committed); the temporaries of
    the crash are gone after that start; every advertised step verifies; nothing recorded before is lost."""
    ctx.stopwatch.fault()
    not_killed = _killed(child)
    if not_killed is not None:
        return inv.outcome([not_killed])
    seen_committed = attempted in dict(child.reports)
    restored = inv.check_newest_restores(workload, root, fresh_process=True,
                                         allowed_steps={attempted} if seen_committed else allowed)
    recovery = ctx.stopwatch.since_fault()
    checks = [restored, inv.check_no_temporaries(root), inv.check_nothing_partial(root, allowed=allowed),
              inv.check_nothing_lost(before, root, keep_last=keep_last)]
    return inv.outcome(checks, recovery_s=recovery, detail=restored.detail if restored.ok else "")


@row(1, "kill -9 at a random byte while a shard is written", short_runs=2, long_runs=500)
def kill_at_a_random_data_write(ctx: RunContext) -> Outcome:
    """SIGKILL the n-th time a piece of step 2's data file is written (n drawn from the seed)."""
    root = ctx.path("local")
    _commit_first_step(root, SMALL)
    before = inv.record_committed(root)
    kill = KillAt("data-write", ctx.rng.randint(1, DATA_WRITES))
    child = crash_injector().run(save_steps, str(root), 2, 1, SMALL.nbytes, settings=SMALL_CHUNKS, kill_at=kill)
    return _after_crash(ctx, root, SMALL, before, child, attempted=2, allowed={1}, keep_last=None)


@row(1, "kill -9 at a random byte while a shard is written", short_runs=1, long_runs=500)
def kill_at_a_random_moment_of_a_save(ctx: RunContext) -> Outcome:
    """SIGKILL a random delay (drawn from the seed) after a 16 MiB save of step 2 started: mid-write,
    mid-commit or after it; the restart finds step 1, or step 2 whole."""
    root = ctx.path("local")
    _commit_first_step(root, TIMED)
    before = inv.record_committed(root)
    delay = ctx.rng.uniform(0.0, TIMED_WINDOW_S)
    child = crash_injector().run(save_steps, str(root), 2, 1, TIMED.nbytes, hold=True, kill_after_s=delay)
    outcome = _after_crash(ctx, root, TIMED, before, child, attempted=2, allowed={1, 2}, keep_last=1)
    return Outcome(outcome.held, outcome.checked, outcome.recovery_s, outcome.step_recovery_s, outcome.bytes_lost,
                   f"killed {delay * 1000:.1f} ms into the save; {outcome.detail}")


@row(2, "kill -9 between the last shard fsync and the manifest rename")
def kill_before_the_manifest_rename(ctx: RunContext) -> Outcome:
    """SIGKILL when step 2's manifest is written and fsynced but not renamed into place."""
    root = ctx.path("local")
    _commit_first_step(root, SMALL)
    before = inv.record_committed(root)
    child = crash_injector().run(save_steps, str(root), 2, 1, SMALL.nbytes, settings=SMALL_CHUNKS,
                                 kill_at=KillAt("manifest-commit"))
    left = inv.leftover_temporaries(root)
    if not left:
        return inv.outcome([inv.Check("L3", False, "the kill left no temporary manifest: it did not cut the commit")])
    return _after_crash(ctx, root, SMALL, before, child, attempted=2, allowed={1}, keep_last=None)


@row(3, "kill -9 after the manifest rename, before the directory fsync and retention")
def kill_after_the_manifest_rename(ctx: RunContext) -> Outcome:
    """SIGKILL right after step 2's manifest is renamed into place: the restart restores step 1 or step 2,
    and both verify (retention, keep_local=1, had not run yet: step 1 must still be whole)."""
    root = ctx.path("local")
    _commit_first_step(root, SMALL)
    before = inv.record_committed(root)
    child = crash_injector().run(save_steps, str(root), 2, 1, SMALL.nbytes, settings=SMALL_CHUNKS,
                                 kill_at=KillAt("committed"))
    outcome = _after_crash(ctx, root, SMALL, before, child, attempted=2, allowed={1, 2}, keep_last=None)
    both = inv.advertised_steps(root)
    if outcome.held and both != [1, 2]:
        return Outcome(False, outcome.checked, outcome.recovery_s, None, 0,
                       f"after a kill at the rename the root lists {both}, expected both [1, 2]")
    return outcome


@row(21, "local NVMe tier wiped or node replaced")
def local_tier_wiped(ctx: RunContext) -> Outcome:
    """Steps 1-2 promoted to S3, then ``rm -rf`` of the whole local root: a fresh process on an empty local
    root restores step 2 from the object tier, verified, bit-exact."""
    import shutil

    root, remote = ctx.path("local"), ctx.s3("wiped")
    with CheckpointManager(root, remote=remote.url, storage_options=remote.storage_options,
                           policy=Policy(keep_local=2, keep_remote=2), capture_rng=False, daemon="off") as manager:
        for step in (1, 2):
            manager.save(step, SMALL.state(step), force=True)
            manager.wait()
        manager.wait_uploads()
    before = inv.record_committed(remote)
    if before.numbers != [1, 2]:
        return inv.outcome([inv.Check("L2", False, f"the object tier holds {before.numbers} before the wipe, "
                                                   "expected [1, 2]")])
    shutil.rmtree(root)
    ctx.stopwatch.fault()
    restored = inv.check_newest_restores(SMALL, root, remote=remote, fresh_process=True, expected_step=2)
    recovery = ctx.stopwatch.since_fault()
    came_from_object = inv.Check("L1", "object" in restored.detail,
                                 f"restored from the wrong tier: {restored.detail}")
    return inv.outcome([restored, came_from_object, inv.check_nothing_partial(remote),
                        inv.check_nothing_lost(before, remote)], recovery_s=recovery)
