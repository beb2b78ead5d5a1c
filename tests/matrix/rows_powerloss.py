"""Fault-matrix row 4: power loss, with writes not yet fsynced lost, torn or reordered.

Each run records a real save of one shape (:mod:`harness.crash_replay`: the manager writes through
ckptd's own file layer while the ``os``-level recorder logs every operation), then draws crash states
from the ALICE model (:mod:`harness.crash_states`): the run's generator picks the crash point (after
any operation of the save) and the subset of pending operations that reached the disk (per directory a
prefix of its entry changes since its last fsync; per unsynced write keep, drop, zero-fill or a tear at
a 4 KiB boundary). Every state is written into a scratch directory and opened by a fresh manager, which
must restore the newest committed step bit-exact (L1), still hold every step whose commit was
acknowledged before the crash (L2), and list nothing partial or unverified, with no temporary left (L3);
then the job goes on: the next step saved after recovery (into what a crashed attempt left, when the crash
interrupted that step) must commit and verify. ``recovery_s`` is the power loss to the restore,
``step_recovery_s`` to that next commit.

Shapes: the first step of a run; the first step into a checkpoint root that does not exist yet (the
recording starts before the manager is built, so the root's creation is in the trace); a later step
with ``keep_local=1`` (the old step's unlinks are in the trace); packed small chunks next to large
chunks written with ``O_DIRECT`` into parallel data files; and two ranks (threads with one in-process
c10d store) writing into one directory; a later step saved into the step directory an attempt killed
before its root fsync left (that ``mkdir`` is in the trace, not durable). No root needed: the states are
built from the trace, not from a block device.
"""

from __future__ import annotations

from harness.crash_replay import (FIRST_STEP, FRESH_ROOT, LATER_STEP_RETENTION, LEFTOVER_STEP_DIRECTORY,
                                        PACKED_AND_DIRECT, TWO_RANKS, SaveShape, check_state, record_save)
from harness.matrix import Outcome, RunContext, row

TITLE = "Power loss / reordering of writes not yet fsynced"
#: Crash states checked per run (each one is a fresh start on its own scratch directory).
STATES_PER_RUN = 4


def _power_loss(ctx: RunContext, shape: SaveShape) -> Outcome:
    recording = record_save(shape, ctx.path("recorded"))
    model = recording.model
    problems: list[str] = []
    worst = worst_step = 0.0
    lost = 0
    for number in range(STATES_PER_RUN):
        state = model.random_state(ctx.rng)
        verdict = check_state(recording, state, ctx.workdir / f"state-{number}", on_written=ctx.stopwatch.fault)
        worst = max(worst, verdict.recovery_s)
        worst_step = max(worst_step, verdict.step_recovery_s or 0.0)
        lost += verdict.bytes_lost
        if not verdict.held:
            problems.append("; ".join(verdict.problems) + "\n" + state.describe(recording.trace))
    detail = (f"{len(recording.trace.ops)} ops ({recording.trace.summary()}), {model.total()} states in the "
              f"model, {STATES_PER_RUN} checked")
    if problems:
        detail = f"{len(problems)} of {STATES_PER_RUN} crash states did not recover: " + " || ".join(problems)
    return Outcome(held=not problems, checked=("L1", "L2", "L3"), recovery_s=worst, step_recovery_s=worst_step,
                   bytes_lost=lost, detail=detail)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_first_step(ctx: RunContext) -> Outcome:
    """The first save into an empty directory."""
    return _power_loss(ctx, FIRST_STEP)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_fresh_root(ctx: RunContext) -> Outcome:
    """The manager's start on a root it creates, then the first save."""
    return _power_loss(ctx, FRESH_ROOT)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_later_step_with_retention(ctx: RunContext) -> Outcome:
    """A second save with ``keep_local=1``: the new step's commit, then the old step's deletion."""
    return _power_loss(ctx, LATER_STEP_RETENTION)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_packed_and_direct_io(ctx: RunContext) -> Outcome:
    """Small chunks packed through the page cache, large ones with O_DIRECT into two parallel files."""
    return _power_loss(ctx, PACKED_AND_DIRECT)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_two_ranks_one_directory(ctx: RunContext) -> Outcome:
    """Two ranks sharing a directory (rank 0 owns the commit marker and retention, keep_local=1)."""
    return _power_loss(ctx, TWO_RANKS)


@row(4, TITLE, short_runs=2, long_runs=500)
def power_loss_into_a_killed_attempts_step_directory(ctx: RunContext) -> Outcome:
    """A save into the step directory an attempt killed before the fsync of the root left behind."""
    return _power_loss(ctx, LEFTOVER_STEP_DIRECTORY)
