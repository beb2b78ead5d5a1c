"""Fault-matrix rows 19 and 20: a rank hangs in the save barrier, a rank dies mid-training, under ``ckptd launch``.

Each run is a real ``ckptd launch`` of the 2-rank gloo job :mod:`harness.elastic_training`
(:func:`~harness.elastic_runs.launch_job`), which checkpoints every 2 steps into one directory per rank
and records, per generation, each rank's pid, restored step and tier and when it restored and completed its
first step. The victim rank (drawn from the seed) signals itself at a step and phase drawn from the seed:

- 19: SIGSTOP right after a save was staged, so its writer stops before its commit vote and the other rank
  waits in the commit barrier; the supervisor's hang timeout (4 s here) finds the missing heartbeat, kills
  the stopped rank and restarts it alone;
- 20: SIGKILL before the step, before or after its save, or once that save is committed.

Held: the job ends (exit 0) with the weights, optimizer state and sample ids of an uninterrupted run of the
same job, byte for byte (L5; the golden run is launched once per process); every rank restored the same
step in the next generation, the restarted rank from a tier on disk and the survivor without a restart (L1);
every step a rank directory advertises verifies and the ranks' directories hold the same committed steps
(L3). Recovery: from the signal to the restarted rank's restore (``recovery_s``) and to its first completed
step (``step_recovery_s``), from the wall-clock times the ranks wrote.

All three are out of the short mode (``short_runs=0``: each run is a ckptd launch of a 2-rank job, 10-20 s on two
busy cores): ``tests/test_elastic_launch.py`` runs a hang found by timeout, SIGKILLs at several steps and
phases, and seed 2000007 (a rank lost before the first commit) in the default run.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from harness import invariants as inv
from harness.elastic_runs import WORLD, finals, generations, launch_job
from harness.matrix import Outcome, RunContext, row

EVERY = 2  # the job's save interval (its default)
STEPS = 12  # the job's length (its default)
_golden: dict[str, list[bytes]] = {}


def _reference() -> list[bytes]:
    """The final weights, optimizer state and sample ids of each rank of an uninterrupted run (once per process)."""
    if "finals" not in _golden:
        base = Path(tempfile.mkdtemp(prefix="ckptd-matrix-elastic-golden-"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
        result = launch_job(base)
        if result.returncode != 0:
            raise RuntimeError(f"the uninterrupted run failed ({result.returncode}): {result.stderr[-3000:]}")
        _golden["finals"] = finals(base / "out")
    return _golden["finals"]


def _ids(written: list[bytes]) -> list[Any]:
    return [sample for final in written for rows in json.loads(final)["seen"] for sample in rows]


def _check_run(ctx: RunContext, result: Any, victim: int, cause: str, *, committed: bool | None = True
               ) -> tuple[list[inv.Check], float | None, float | None]:
    """The checks of one launched run (module docstring); ``committed``: whether a step must have been
    restored in generation 1 (False: the kill came before any commit, every rank starts afresh; None: either,
    when the kill may come before the first save's asynchronous commit ended)."""
    out = ctx.workdir / "out"
    reference = _reference()
    if result.returncode != 0:
        return [inv.Check("L5", False, f"the job failed ({result.returncode}): {result.stderr[-1500:]}")], None, None
    written = finals(out)
    checks = [inv.check_same_run(_ids(reference), _ids(written), inv.state_digest(reference),
                                 inv.state_digest(written))]
    records = {rank: generations(out, rank) for rank in range(WORLD)}
    restored = {rank: records[rank].get(1, {}).get("restored") for rank in range(WORLD)}
    tiers = {rank: records[rank].get(1, {}).get("tier") for rank in range(WORLD)}
    joined = {rank: sorted(records[rank]) for rank in range(WORLD)}
    pids = {rank: [records[rank][g]["pid"] for g in sorted(records[rank])] for rank in range(WORLD)}
    only_victim = all(len(set(pids[rank])) == (2 if rank == victim else 1) for rank in range(WORLD))
    checks.append(inv.Check("L1", all(sorted(g) == [0, 1] for g in joined.values()) and only_victim,
                            f"generations joined {joined}, pids {pids}: only rank {victim} restarts, once"))
    agreed = len(set(restored.values())) == 1 and (committed is None or (restored[victim] is not None) == committed)
    on_disk = restored[victim] is None or str(tiers[victim]).startswith(("local", "peer", "object"))
    checks.append(inv.Check("L1", agreed and on_disk,
                            f"generation 1 restored steps {restored} from tiers {tiers}"))
    checks.append(inv.Check("L1", cause in result.stderr, f"the supervisor did not report {cause!r}"))
    committed = {}
    for rank in range(WORLD):
        directory = ctx.workdir / "ckpt-node0" / f"rank{rank}"
        checks.append(inv.check_nothing_partial(directory))
        committed[rank] = inv.advertised_steps(directory)
    checks.append(inv.Check("L3", len({tuple(steps) for steps in committed.values()}) == 1,
                            f"the ranks' directories hold different committed steps: {committed}"))
    killed = json.loads((out / f"rank{victim}-killed.json").read_text())["at"]
    second = records[victim].get(1, {})
    recovery_s = second["restored_at"] - killed if "restored_at" in second else None
    step_recovery_s = second["first_step_at"] - killed if "first_step_at" in second else None
    return checks, recovery_s, step_recovery_s


@row(19, "a rank hangs (SIGSTOP) in the save barrier under ckptd launch", short_runs=0, long_runs=30)
def rank_hangs_in_save_barrier(ctx: RunContext) -> Outcome:
    victim = ctx.rng.choice(range(WORLD))
    step = EVERY * ctx.rng.randint(2, STEPS // EVERY - 1)  # a step that saves
    job = ["--kill-rank", str(victim), "--kill-step", str(step), "--kill-signal", "STOP", "--kill-phase", "after-save"]
    _reference()
    result = launch_job(ctx.workdir, *job, hang_timeout=4.0)
    checks, recovery_s, step_recovery_s = _check_run(ctx, result, victim, f"rank {victim} (pid ")
    if result.returncode == 0:
        hung = f"rank {victim} (pid {generations(ctx.workdir / 'out', victim)[0]['pid']}) hung (no heartbeat"
        checks.append(inv.Check("L1", hung in result.stderr, f"the supervisor did not report {hung!r}"))
    return inv.outcome(checks, recovery_s=recovery_s, step_recovery_s=step_recovery_s,
                       detail=f"rank {victim} SIGSTOPped after staging step {step}")


@row(20, "a rank SIGKILLed mid-training under ckptd launch", short_runs=0, long_runs=30)
def rank_killed_mid_training(ctx: RunContext) -> Outcome:
    victim = ctx.rng.choice(range(WORLD))
    step = ctx.rng.randint(3, STEPS - 1)
    phase = ctx.rng.choice(["before-step", "before-save", "after-save", "after-commit"])
    job = ["--kill-rank", str(victim), "--kill-step", str(step), "--kill-signal", "KILL", "--kill-phase", phase]
    _reference()
    result = launch_job(ctx.workdir, *job)
    # The job saves every 2 steps, asynchronously: a kill before step 5 (other than after a commit) may come
    # before step 2's commit ended on every rank, and then every rank rightly starts afresh (seed 2000007).
    must_commit = True if phase == "after-commit" or step >= 5 else None
    checks, recovery_s, step_recovery_s = _check_run(ctx, result, victim, "killed by signal SIGKILL",
                                                     committed=must_commit)
    return inv.outcome(checks, recovery_s=recovery_s, step_recovery_s=step_recovery_s,
                       detail=f"rank {victim} SIGKILLed at step {step} ({phase})")


@row(20, "a rank SIGKILLed before any step is committed under ckptd launch", short_runs=0, long_runs=3)
def rank_killed_before_the_first_commit(ctx: RunContext) -> Outcome:
    """The failure of seed 2000007 made deterministic: rank 1 dies at step 2 before its save, so no step was
    ever committed; the generation that follows restores nothing, and the survivor must start again from the
    state its setup built, as the replacement does (:func:`ckptd.elastic.run` builds the survivor's setup
    again when its managers hold no committed step; before that it trained on from its live, advanced state
    and the run diverged)."""
    job = ["--kill-rank", "1", "--kill-step", "2", "--kill-signal", "KILL", "--kill-phase", "before-save"]
    _reference()
    result = launch_job(ctx.workdir, *job)
    checks, recovery_s, step_recovery_s = _check_run(ctx, result, 1, "killed by signal SIGKILL", committed=False)
    return inv.outcome(checks, recovery_s=recovery_s, step_recovery_s=step_recovery_s,
                       detail="rank 1 SIGKILLed at step 2 before its save (no step committed yet)")
