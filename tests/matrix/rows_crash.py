"""Fault-matrix rows of process crashes around a save and of tiers that disagree: 1, 2, 3, 13, 16, 21, 22.

Every crash is a real SIGKILL of a child process that saves through the real local tier
(:mod:`harness.crash`: at a named phase of the save, or after a random delay); the restart that
follows is a fresh process opening a :class:`~ckptd.CheckpointManager` on the same root, as a restarted
job does. States are pure functions of their step (:class:`~harness.invariants.SyntheticWorkload`),
so every check compares the restored bytes with the bytes that were saved.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.config import override
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness import invariants as inv
from harness.crash import ChildResult, KillAt
from harness.matrix import Outcome, RunContext, crash_injector, row
from harness.workloads import save_steps, synthetic_state

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
                 child: ChildResult, *, attempted: int, allowed: set[int], keep_last: int | None,
                 must_list: list[int] | None = None) -> Outcome:
    """The restart after a killed save of ``attempted``: a fresh process restores the newest step (which
    must be one of ``allowed``, and ``attempted`` when the child saw it committed); the temporaries of
    the crash are gone after that start; every advertised step verifies; nothing recorded before is lost
    (and, with ``must_list``, exactly those steps are listed). Then training resumes: the restored step's
    successor is saved and restores (``step_recovery_s``: fault to that commit)."""
    ctx.stopwatch.fault()
    not_killed = _killed(child)
    if not_killed is not None:
        return inv.outcome([not_killed])
    seen_committed = attempted in dict(child.reports)
    restored = inv.check_newest_restores(workload, root, fresh_process=True,
                                         allowed_steps={attempted} if seen_committed else allowed)
    recovery = ctx.stopwatch.since_fault()
    checks = [restored, inv.check_no_temporaries(root),
              *inv.check_committed(before, root, keep_last=keep_last, allowed=allowed)]
    if must_list is not None:
        listed = inv.advertised_steps(root)
        checks.append(inv.Check("L2", listed == must_list, f"after the restart the root lists {listed}, "
                                                           f"expected {must_list}"))
    resumed, next_step = _resume_one_step(root, workload)
    step_recovery = ctx.stopwatch.since_fault()
    checks += [resumed, inv.check_newest_restores(workload, root, expected_step=next_step)]
    return inv.outcome(checks, recovery_s=recovery, step_recovery_s=step_recovery,
                       detail=restored.detail if restored.ok else "")


def _resume_one_step(root: Path, workload: inv.SyntheticWorkload) -> tuple[inv.Check, int | None]:
    """Training goes on after the restart: restore, save the next step, wait for its commit."""
    try:
        with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
            step = manager.restore(workload.template())
            if step is None:
                return inv.Check("L1", False, "the resumed job found no checkpoint"), None
            manager.save(step + 1, workload.state(step + 1), force=True)
            manager.wait()
    except Exception as error:  # noqa: BLE001 - the first save after the crash failing is a finding
        return inv.Check("L1", False, f"the first save after the restart failed: {type(error).__name__}: {error}"), None
    return inv.Check("L1", True, f"resumed from step {step}, saved step {step + 1}"), step + 1


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
    return _after_crash(ctx, root, SMALL, before, child, attempted=2, allowed={1, 2}, keep_last=None,
                        must_list=[1, 2])


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
            manager.wait_uploads()  # a newer commit supersedes a step whose upload has not started
    before = inv.record_committed(remote)
    if before.numbers != [1, 2]:
        return inv.outcome([inv.Check("L2", False, f"the object tier holds {before.numbers} before the wipe, "
                                                   "expected [1, 2]")])
    shutil.rmtree(root)
    ctx.stopwatch.fault()
    restored = inv.check_newest_restores(SMALL, root, remote=remote, fresh_process=True, expected_step=2)
    recovery = ctx.stopwatch.since_fault()
    tiers = restored.facts.get("tiers", ())
    came_from_object = inv.Check("L1", bool(tiers) and all(t.startswith("object") for t in tiers),
                                 f"restored from {tiers}, not from the object tier alone: {restored.detail}")
    return inv.outcome([restored, came_from_object, *inv.check_committed(before, remote)], recovery_s=recovery)


@row(16, "resume polled while a save is in flight")
def restore_polled_during_saves(ctx: RunContext) -> Outcome:
    """A child saves steps back to back while this process lists the root and reads every newly listed
    step (read-only, as ``ckptd restore --step`` does: the writer holds the root's lock): a listed step is
    always whole and bit-exact, the listing never goes backwards, and every step seen stays committed."""
    import threading
    import time

    root = ctx.path("local")
    count = ctx.rng.randint(4, 8)
    finished = threading.Event()
    children: list[ChildResult] = []

    def write() -> None:
        try:
            children.append(crash_injector().run(save_steps, str(root), 1, count, SMALL.nbytes, keep_local=None,
                                                 settings=SMALL_CHUNKS))
        finally:
            finished.set()

    writer = threading.Thread(target=write, name="row16-writer", daemon=True)
    writer.start()
    checks: list[inv.Check] = []
    seen: list[int] = []
    polls = in_flight_polls = 0
    while not finished.is_set():
        polls += 1
        steps = inv.advertised_steps(root) if root.is_dir() else []
        if steps and seen and steps[-1] < seen[-1]:
            checks.append(inv.Check("L3", False, f"the newest listed step went back from {seen[-1]} to {steps[-1]}"))
        in_flight_polls += any(step not in steps for step in _step_dirs(root))
        for step in steps:
            if step not in seen:
                seen.append(step)
                checks.append(inv.check_step_restores(SMALL, root, step))
        time.sleep(0.002)
    writer.join()
    child = children[0] if children else None
    if child is None or child.error is not None or child.exitcode != 0:
        return inv.outcome([inv.Check("L3", False, f"the writer failed: {child.error if child else 'no result'}")])
    checks += [inv.check_nothing_partial(root, allowed=range(1, count + 1)),
               inv.Check("L2", set(seen) <= set(inv.advertised_steps(root)),
                         f"steps seen {seen} are not all committed at the end: {inv.advertised_steps(root)}")]
    if not seen:
        checks.append(inv.Check("L3", False, f"{polls} polls saw no committed step while the writer ran"))
    failed = [c for c in checks if not c.ok]
    return inv.outcome(failed or checks[-3:],
                       detail=f"{polls} polls while {count} saves ran, {len(seen)} steps read as they appeared, "
                              f"{in_flight_polls} polls met a step being written")


def _step_dirs(root: Path) -> list[int]:
    from ckptd.format.layout import parse_step_dir

    try:
        return sorted(step for step in (parse_step_dir(p.name) for p in root.iterdir()) if step is not None)
    except OSError:
        return []


# --- row 22: two "nodes" (gloo ranks), each with its own local root, and one object tier ----------------

NODE_STATE = inv.SyntheticWorkload(256 * 1024, rank_stride=10)


def _save_on_node(rank: int, world_size: int, roots: list[str], remote: str, options: dict, steps: list[int]) -> list[int]:
    with CheckpointManager(roots[rank], remote=remote, storage_options=options, capture_rng=False, daemon="off",
                           policy=Policy(keep_local=None, keep_remote=None)) as manager:
        for step in steps:
            manager.save(step, NODE_STATE.state(step, rank), force=True)
            manager.wait()
        manager.wait_uploads()
        return manager.committed_steps()


def _restore_on_node(rank: int, world_size: int, roots: list[str], remote: str, options: dict) -> dict:
    from ckptd.testing.compare import state_differences

    live = NODE_STATE.template(rank)
    with CheckpointManager(roots[rank], remote=remote, storage_options=options, capture_rng=False, daemon="off",
                           policy=Policy(keep_local=None, keep_remote=None)) as manager:
        step = manager.restore(live)
        result = manager.last_restore
    return {"step": step, "tiers": list(result.tiers) if result else [],
            "differences": state_differences(live, NODE_STATE.state(step, rank)) if step is not None else ["none"]}


@row(22, "tiers disagree on which checkpoint is latest (stale local copy, newer S3 copy)", long_runs=30)
def stale_node_and_newer_object_tier(ctx: RunContext) -> Outcome:
    """Two ranks, one local root each, save steps 1-3 and promote them all. Then the local copy of one or
    both nodes goes stale (its newest steps removed, as a node restored from an older disk image): the
    ranks restore in fresh processes, agree on step 3 (verified on the object tier for every rank), and
    each gets its own rank's bytes of step 3: no rank on an older step, no mixed steps."""
    import shutil

    from ckptd.format.layout import step_dir
    from ckptd.testing.multirank import run_multirank

    roots = [str(ctx.path(f"node{rank}")) for rank in range(2)]
    remote = ctx.s3("nodes")
    committed = run_multirank(_save_on_node, 2, roots, remote.url, remote.storage_options, [1, 2, 3], timeout_s=120)
    if committed != [[1, 2, 3], [1, 2, 3]]:
        return inv.outcome([inv.Check("L2", False, f"the ranks committed {committed}, expected steps 1-3 on both")])
    before = inv.record_committed(remote)
    stale = ctx.rng.choice([[0], [1], [0, 1]])
    dropped = {rank: ctx.rng.choice([[3], [2, 3]]) for rank in stale}
    for rank, steps in dropped.items():
        for step in steps:
            shutil.rmtree(Path(roots[rank]) / step_dir(step))
    ctx.stopwatch.fault()
    results = run_multirank(_restore_on_node, 2, roots, remote.url, remote.storage_options, timeout_s=120)
    recovery = ctx.stopwatch.since_fault()
    steps = [result["step"] for result in results]
    checks = [inv.Check("L1", steps == [3, 3], f"the ranks restored steps {steps}, expected [3, 3]")]
    for rank, result in enumerate(results):
        checks.append(inv.Check("L1", not result["differences"],
                                f"rank {rank} restored step {result['step']} not bit-exact: {result['differences'][:3]}"))
        if rank in dropped:
            checks.append(inv.Check("L1", any(t.startswith("object") for t in result["tiers"]),
                                    f"stale rank {rank} read from {result['tiers']}, not from the object tier"))
    checks += inv.check_committed(before, remote)
    return inv.outcome(checks, recovery_s=recovery,
                       detail=f"stale nodes {sorted(dropped)} lost local steps {dropped}" if all(c.ok for c in checks) else "")


# --- row 13: what a dead writer leaves: stale temporaries, abandoned step directories, orphan uploads ---------

@row(13, "stale temporaries and orphan multipart uploads from a dead writer")
def gc_after_a_dead_writer(ctx: RunContext) -> Outcome:
    """Local tier: a writer killed while retention deleted step 1 (after committing step 2) left step 1
    half-deleted (no manifest, data files); the next writer, killed mid-save of step 3, left step 3's
    temporaries (newer than every commit: a save in progress, for all GC knows). Step 1's directory is
    aged past ``gc_abandoned_s`` or not (drawn from the seed). A collector that runs before any restart
    removes step 1 only when expired, never step 3, never committed step 2, which restores bit-exact;
    the next start then removes step 3's temporaries. Object tier: orphan multipart uploads of a dead
    writer on this host, of a host whose owner record expired (its lease ran out on the store's clock,
    unrefreshed), of a live host with a fresh record, and one with no record (old or new by the seed): GC
    aborts exactly the abandoned ones and deletes no committed object."""
    import os
    import time

    from ckptd.format.layout import step_dir
    from ckptd.promotion.gc import collect_garbage
    from ckptd.tiers.local import LocalTier

    root = ctx.path("local")
    _commit_first_step(root, SMALL)
    first = crash_injector().run(save_steps, str(root), 2, 1, SMALL.nbytes, settings=SMALL_CHUNKS, keep_local=1,
                                 kill_at=KillAt("retention"))
    second = crash_injector().run(save_steps, str(root), 3, 1, SMALL.nbytes, settings=SMALL_CHUNKS, keep_local=1,
                                  kill_at=KillAt("data-write", ctx.rng.randint(1, DATA_WRITES)))
    for child in (first, second):
        not_killed = _killed(child)
        if not_killed is not None:
            return inv.outcome([not_killed])
    if _step_dirs(root) != [1, 2, 3] or inv.advertised_steps(root) != [2] or not inv.leftover_temporaries(root):
        return inv.outcome([inv.Check("L3", False, f"the dead writers left steps {_step_dirs(root)}, committed "
                                                   f"{inv.advertised_steps(root)}: not the state this row sets up")])
    threshold = 3600.0
    expired = ctx.rng.random() < 0.5
    age = threshold * (2.0 if expired else 0.5)
    old = time.time() - age
    for path in [*(root / step_dir(1)).iterdir(), root / step_dir(1)]:
        os.utime(path, (old, old))
    before = inv.record_committed(root)
    ctx.stopwatch.fault()
    local = LocalTier(root)
    try:
        report = collect_garbage(local, retention=None, abandoned_after_s=threshold)
    finally:
        local.close()
    listed = _step_dirs(root)
    checks = [
        inv.Check("L2", (1 not in listed) == expired,
                  f"half-deleted step 1 ({age:.0f} s old, threshold {threshold:.0f} s) "
                  f"{'kept' if 1 in listed else 'removed'}; GC report {report}"),
        inv.Check("L2", 3 in listed, f"GC removed step 3, the newest save (in progress as far as GC knows): {report}"),
        *inv.check_committed(before, root, allowed={2}),
        inv.check_newest_restores(SMALL, root, expected_step=2, fresh_process=True), inv.check_no_temporaries(root),
    ]
    recovery = ctx.stopwatch.since_fault()
    checks += _orphan_uploads(ctx)
    return inv.outcome(checks, recovery_s=recovery)


#: The lease of the "expired" owner record: its host stopped refreshing it; the store's clock ages it.
EXPIRING_LEASE_S = 1.0


def _orphan_uploads(ctx: RunContext) -> list[inv.Check]:
    import dataclasses
    import time

    import boto3

    from ckptd.promotion.gc import collect_garbage
    from ckptd.tiers.object import ObjectTier
    from ckptd.tiers.upload_owners import UploadOwner, key_directory

    remote = ctx.s3("orphans")
    with CheckpointManager(ctx.path("promoter"), remote=remote.url, storage_options=remote.storage_options,
                           capture_rng=False, daemon="off", policy=Policy(keep_local=None, keep_remote=None)) as manager:
        manager.save(1, SMALL.state(1), force=True)
        manager.wait()
        manager.wait_uploads()
    before = inv.record_committed(remote)
    boto = boto3.client("s3", endpoint_url=remote.endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")
    prefix = remote.url.split("/", 3)[3]
    dead = _dead_pid()
    no_record_old = ctx.rng.random() < 0.5
    uploads = {  # relative key -> (owner record or None, whether GC must abort it)
        "chunks/aa/dead-writer-here.raw": (None, "dead", True),
        "chunks/bb/expired-other-host.raw": (None, "expired", True),
        "chunks/cc/live-other-host.raw": (None, "live", False),
        "chunks/dd/no-record.raw": (None, "none", no_record_old),
    }
    tier = ObjectTier(remote.url, storage_options=remote.storage_options)
    try:
        for key, (_, kind, _) in uploads.items():
            if kind != "none":
                mine = UploadOwner.mine(key)
                owner = {"dead": dataclasses.replace(mine, pid=dead),
                         "expired": dataclasses.replace(mine, host="another-host", lease_s=EXPIRING_LEASE_S),
                         "live": dataclasses.replace(mine, host="another-host", pid=dead)}[kind]
                tier.write_bytes(f"{key_directory(key)}/{kind}-{dead}.json", owner.to_json_bytes())
            boto.create_multipart_upload(Bucket=remote.bucket, Key=f"{prefix}/{key}")
        written = time.monotonic()
        started = min(u["Initiated"].timestamp() for u in boto.list_multipart_uploads(Bucket=remote.bucket)["Uploads"])
        age = max(0.0, time.time() - started)
        threshold = max(0.0, age - 1.0) if no_record_old else age + 3600.0
        # records are judged by their age on the store's clock: let the short one run out, unrefreshed
        time.sleep(max(0.0, 1.5 * EXPIRING_LEASE_S - (time.monotonic() - written)))
        report = collect_garbage(tier, abandoned_after_s=threshold)
    finally:
        tier.close()
    left = {u["Key"][len(prefix) + 1:] for u in boto.list_multipart_uploads(Bucket=remote.bucket).get("Uploads", [])}
    expected_left = {key for key, (_, _, aborted) in uploads.items() if not aborted}
    return [inv.Check("L2", left == expected_left,
                      f"uploads left after GC {sorted(left)}, expected {sorted(expected_left)} (report {report})"),
            *inv.check_committed(before, remote)]


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (a dead writer)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
