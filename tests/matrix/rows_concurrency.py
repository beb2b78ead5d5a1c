"""Fault-matrix rows 14, 15 and 17: two writers of one checkpoint, GC racing readers and saves, saves back
to back.

- 14: two managers on one local directory (the second is a real second process: it fails with
  LockedError and the first's steps stay intact), and two promoters of one step on S3 racing in two real
  processes, released at the same instant: of the same step (both succeed, one manifest), and of two
  different jobs' steps with the same number (one wins on ``If-None-Match``, the loser gets 412 and aborts,
  the winner's step restores bit-exact). moto's server honours ``If-None-Match`` on PUT and on multipart
  completion; the scenario checks that too, with plain boto3.
- 15: the Hypothesis state machine of ``tests/test_promotion_gc_state_machine.py`` (save, promote, GC, GC
  in the middle of a promotion, restore, on the object tier), extended with the local tier's pins (a step
  pinned for promotion, local retention racing it, a restore from the pin), seeded from the run's seed.
- 17: a manager saving every step with an object tier: saves never pile up (the uploader keeps at most one
  step in flight and one queued), the loop ends within its deadline, every committed step verifies.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from ckptd.config import override
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import KeepLatest, Policy
from harness.crash import CrashInjector
from harness.invariants import (Check, SyntheticWorkload, check_newest_restores, check_nothing_lost,
                                      check_nothing_partial, outcome, record_committed)
from harness.matrix import Outcome, RunContext, row
from harness.s3_scenarios import (look_behind, promote_when_released, release_racers, s3_client,
                                        save_steps_locally)
from harness.workloads import open_manager
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

KIB = 1024
STATE = SyntheticWorkload(256 * KIB)
#: Another job's states: the same structure, other bytes at every step.
OTHER_JOB = SyntheticWorkload(256 * KIB, rank_stride=1000)

_INJECTOR: CrashInjector | None = None


def _injector() -> CrashInjector:
    global _INJECTOR
    if _INJECTOR is None:
        _INJECTOR = CrashInjector(timeout_s=120.0)
    return _INJECTOR


# --- row 14 --------------------------------------------------------------------------------------

@row(14, "Two managers on one directory (two processes)", short_runs=1, long_runs=100)
def second_manager_locked_out(ctx: RunContext) -> Outcome:
    """A manager holds a directory with committed steps; a second process opening a manager on it gets
    LockedError naming the holder; the first's steps stay intact and it keeps saving; once it closed, the
    newest step restores bit-exact."""
    directory = ctx.path("local")
    steps = ctx.rng.randint(1, 3)
    first = CheckpointManager(directory, capture_rng=False, policy=Policy(keep_local=None), daemon="off")
    try:
        for step in range(1, steps + 1):
            first.save(step, STATE.state(step), force=True)
        first.wait()
        before = record_committed(directory)
        child = _injector().run(open_manager, str(directory))
        message = str(child.value or child.error)
        checks = [Check("L2", message.startswith("LockedError: another checkpoint manager") and
                        str(directory) in message, f"the second process got: {message[:200]}")]
        checks.append(check_nothing_lost(before, directory))
        first.save(steps + 1, STATE.state(steps + 1), force=True)
        first.wait()
    finally:
        first.close()
    checks.append(check_newest_restores(STATE, directory, expected_step=steps + 1))
    return outcome(checks)


def _race(ctx: RunContext, loc: Any, locals_: list[Path], step: int) -> list[str]:
    """Promote ``step`` of each local directory to ``loc`` from one process each, all released at once."""
    start = ctx.workdir / "start"
    results: list[str] = [""] * len(locals_)

    def promote(index: int) -> None:
        child = _injector().run(promote_when_released, str(locals_[index]), loc.url, loc.storage_options, step,
                                str(start))
        results[index] = str(child.value if child.error is None else child.error.strip().splitlines()[-1])

    threads = [threading.Thread(target=promote, args=(index,), name=f"race-{index}") for index in range(len(locals_))]
    for thread in threads:
        thread.start()
    release_racers(start, len(locals_))
    for thread in threads:
        thread.join(180)
    return results


def _conditional_put_honoured(loc: Any, key: str) -> Check:
    """The store refuses ``If-None-Match: *`` on an existing key with 412 and keeps the object."""
    from botocore.exceptions import ClientError

    client = s3_client(loc.endpoint_url)
    before = client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
    try:
        client.put_object(Bucket=loc.bucket, Key=key, Body=b"{}", IfNoneMatch="*")
        refused = "accepted"
    except ClientError as error:
        refused = str(error.response.get("Error", {}).get("Code"))
    after = client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
    return Check("L2", refused == "PreconditionFailed" and after == before,
                 f"a second conditional PUT of the manifest: {refused}; manifest unchanged: {after == before}")


@row(14, "Two promoters of the same step (two processes)", short_runs=1, long_runs=100)
def two_promoters_same_step(ctx: RunContext) -> Outcome:
    """Two processes promote the same committed local step at the same instant: both end without error
    (the loser's conditional manifest PUT gets 412, finds the identical manifest and counts as done), the
    object tier holds one manifest and nothing stray, and the step restores bit-exact."""
    loc = ctx.s3()
    local = ctx.path("local")
    save_steps_locally(local, STATE, [1])
    results = _race(ctx, loc, [local, local], 1)
    checks = [Check("L2", all(result in ("committed", "already committed") for result in results),
                    f"promoters: {results}"), check_nothing_lost(record_committed(local), loc)]
    checks += _one_step_checks(ctx, loc, STATE, 1)
    return outcome(checks, detail=f"promoters: {results}")


@row(14, "Two jobs promote different steps with one number (two processes)", short_runs=1, long_runs=100)
def two_jobs_same_step_number(ctx: RunContext) -> Outcome:
    """Two jobs (two local directories with different states at step 1) promote into one prefix at the same
    instant: exactly one commits; the other aborts with a commit error (412 on the manifest, or the other
    step found first) and reports it; the object tier's manifest is the winner's, byte for byte, and the
    step restores bit-exact as the winner saved it (the loser's index never replaces the winner's)."""
    loc = ctx.s3()
    jobs = [(ctx.path("job-a"), STATE), (ctx.path("job-b"), OTHER_JOB)]
    for directory, workload in jobs:
        save_steps_locally(directory, workload, [1])
    results = _race(ctx, loc, [directory for directory, _ in jobs], 1)
    remote = ObjectTier(loc.url, storage_options=loc.storage_options)
    try:
        manifest = remote.read_bytes(step_file(1, MANIFEST_NAME))
    finally:
        remote.close()
    winners = [index for index, (directory, _) in enumerate(jobs)
               if LocalTier(directory, create=False).read_bytes(step_file(1, MANIFEST_NAME)) == manifest]
    committed = [index for index, result in enumerate(results) if result == "committed"]
    refused = [index for index, result in enumerate(results)
               if result.startswith(("CommitError:", "AlreadyCommittedError:"))]
    checks = [Check("L2", len(winners) == 1 and committed == winners and len(refused) == 1,
                    f"manifest of job {winners}; committed: {committed}; refused: {refused}; results: {results}")]
    winner = winners[0] if len(winners) == 1 else 0
    checks.append(check_nothing_lost(record_committed(jobs[winner][0]), loc))
    checks += _one_step_checks(ctx, loc, jobs[winner][1], 1)
    return outcome(checks, detail=f"results: {results}")


def _one_step_checks(ctx: RunContext, loc: Any, workload: SyntheticWorkload, step: int) -> list[Check]:
    remote = ObjectTier(loc.url, storage_options=loc.storage_options)
    try:
        committed = remote.committed_steps()
        found = look_behind(loc.endpoint_url, loc.url, remote)
    finally:
        remote.close()
    return [Check("L2", committed == [step], f"committed on the object tier: {committed}"),
            Check("L3", found.clean, found.describe()),
            check_newest_restores(workload, remote=loc, expected_step=step, scratch=ctx.workdir),
            _conditional_put_honoured(loc, f"{loc.url.split('/', 3)[3]}/{step_file(step, MANIFEST_NAME)}")]


# --- row 15 --------------------------------------------------------------------------------------

def _state_machine_module() -> Any:
    """``tests/test_promotion_gc_state_machine.py`` (and the helpers it imports from ``tests/``)."""
    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import test_promotion_gc_state_machine

    return test_promotion_gc_state_machine


class _BucketMaker:
    """What the state machine asks of its S3 server (``create_bucket``, ``storage_options``), on the
    matrix's shared endpoint."""

    def __init__(self, ctx: RunContext) -> None:
        self.location = ctx.s3()
        self.storage_options = self.location.storage_options

    def create_bucket(self, name: str) -> None:
        s3_client(self.location.endpoint_url).create_bucket(Bucket=name)


def _with_local_pins(machine: type) -> type:
    """The object-tier machine plus the local tier's side: pin a step for promotion, local retention racing
    the pin, restore from the pin; invariants: retention never deletes the newest committed local step,
    and every pinned step reads back bit-exact from its pin."""
    from hypothesis import strategies as st
    from hypothesis.stateful import invariant, precondition, rule

    from ckptd.promotion import collect_garbage
    from ckptd.promotion.pinning import PinnedSteps
    from ckptd.stepio.step_reader import ChunkSource, StepReader, load_rank_index, load_step_manifest

    def read_back(tier: LocalTier, step: int) -> dict[str, Any]:
        index = load_rank_index(tier, load_step_manifest(tier, step), 0)
        reader = StepReader([ChunkSource(tier, index)])
        return {name: reader.read_tensor(name) for name in ("frozen", "trained")}

    class WithLocalPins(machine):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.pins = PinnedSteps(self.manager.local)
            self.pinned: set[int] = set()

        def _local_steps(self) -> list[int]:
            return self.manager.local.committed_steps()

        def _unpromoted(self) -> list[int]:  # only what local retention left can be promoted
            local = set(self._local_steps())
            return [step for step in super()._unpromoted() if step in local]

        @precondition(lambda self: self._local_steps())
        @rule(data=st.data())
        def pin(self, data: st.DataObject) -> None:
            step = data.draw(st.sampled_from(self._local_steps()))
            names = self.manager.local.list_files(step)
            self.pins.pin(step, names)
            self.pinned.add(step)

        @rule(keep=st.integers(1, 2))
        def local_retention(self, keep: int) -> None:
            newest = max(self._local_steps(), default=None)
            collect_garbage(self.manager.local, retention=KeepLatest(keep))
            assert newest is None or newest in self._local_steps(), f"retention deleted the newest step {newest}"

        @precondition(lambda self: self.pinned)
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            step = data.draw(st.sampled_from(sorted(self.pinned)))
            self.pins.release(step)
            self.pinned.discard(step)

        @invariant()
        def pinned_steps_read_back(self) -> None:
            assert sorted(self.pinned) == self.pins.pinned(), f"pins {self.pins.pinned()} != {sorted(self.pinned)}"
            for step in self.pinned:
                for name, tensor in read_back(self.pins.tier, step).items():
                    assert tensor.equal(self.saved[step][name]), f"pinned step {step} {name} differs"

    WithLocalPins.__name__ = WithLocalPins.__qualname__ = f"{machine.__name__}WithLocalPins"
    return WithLocalPins


@row(15, "Retention GC racing a reader or a save (state machine)", short_runs=1, long_runs=100)
def gc_state_machine(ctx: RunContext) -> Outcome:
    """One example of save / promote / GC / GC mid-promotion / restore / pin / local retention / release
    (Hypothesis, seeded from the run's seed): GC never deletes a retained or pinned step, the object tier
    never lists a step it cannot restore byte for byte, local retention keeps the newest step."""
    from hypothesis import HealthCheck, seed, settings
    from hypothesis.stateful import get_state_machine_test

    module = _state_machine_module()
    machine = _with_local_pins(module._machine(_BucketMaker(ctx), ctx.workdir))
    test = get_state_machine_test(machine, settings=settings(
        max_examples=1, stateful_step_count=ctx.rng.randint(4, 8), deadline=None, database=None,
        suppress_health_check=list(HealthCheck), phases=("generate",), print_blob=True))
    try:
        seed(ctx.seed)(test)()
    except Exception as error:  # noqa: BLE001 - a failing example is a finding: reported with its seed
        return outcome([Check("L2", False, f"{type(error).__name__}: {str(error)[:400]}")])
    return outcome([Check("L2", True, "no retained, pinned or newest step deleted"),
                    Check("L1", True, "every retained step restored byte for byte"),
                    Check("L3", True, "every listed step verified")])


# --- row 17 --------------------------------------------------------------------------------------

#: The loop must end within this; past it, it counts as a deadlock.
DEADLINE_S = 90.0


@row(17, "Back-to-back async saves with an object tier", short_runs=1, long_runs=100)
def back_to_back_saves(ctx: RunContext) -> Outcome:
    """Save every step (20-40 steps, ``on_busy`` wait or skip from the seed) with an object tier: the loop
    and the uploads end within the deadline, the uploader never holds more than one step in flight and one
    queued, every committed step on both tiers verifies, and the newest restores bit-exact from each."""
    loc = ctx.s3()
    local = ctx.path("local")
    steps = ctx.rng.randint(20, 40)
    on_busy = ctx.rng.choice(["wait", "skip"])
    observed: list[int] = []
    failure: list[BaseException] = []
    last: list[int] = []

    def loop() -> None:
        try:
            with CheckpointManager(local, remote=loc.url, storage_options=loc.storage_options, capture_rng=False,
                                   policy=Policy(keep_local=2, keep_remote=2, on_busy=on_busy),
                                   daemon="off") as manager:
                for step in range(1, steps + 1):
                    manager.save(step, STATE.state(step))
                    uploader = manager.uploader
                    observed.append(len(uploader.unpromoted) if uploader is not None else 0)
                manager.wait()
                last.extend(manager.committed_steps()[-1:])
                manager.wait_uploads()
        except BaseException as error:  # noqa: BLE001 - reported as not held
            failure.append(error)

    with override(wait_timeout_s=DEADLINE_S, close_timeout_s=DEADLINE_S):
        ctx.stopwatch.fault()
        worker = threading.Thread(target=loop, name="matrix-back-to-back", daemon=True)
        worker.start()
        worker.join(DEADLINE_S + 30)
        elapsed = ctx.stopwatch.since_fault()
    if worker.is_alive():
        return outcome([Check("L2", False, f"the save loop did not end within {DEADLINE_S + 30:.0f} s")])
    checks = [Check("L2", not failure, f"loop: {failure[0]!r}" if failure else f"{steps} saves ({on_busy})"),
              Check("L2", max(observed, default=0) <= 2, f"most steps awaiting upload: {max(observed, default=0)}")]
    checks.append(check_nothing_partial(local))
    checks.append(check_nothing_partial(loc))
    if last:
        checks.append(check_newest_restores(STATE, local, expected_step=last[0]))
        checks.append(check_newest_restores(STATE, remote=loc, expected_step=last[0], scratch=ctx.workdir))
    else:
        checks.append(Check("L1", False, "no step committed"))
    return outcome(checks, recovery_s=None, detail=f"{steps} steps, on_busy={on_busy}, {elapsed:.1f}s")
