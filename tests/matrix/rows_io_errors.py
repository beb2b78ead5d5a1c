"""Fault-matrix rows 5, 6, 7 and 18: I/O errors under a save.

Every scenario commits step 1 on a local root (``keep_local=1``, so that retention would delete it as
soon as anything newer commits), makes the disk fail while step 2 is saved, and then checks that the
save failed with a typed error naming the file, step 2 and the tier (L4), that nothing of step 2 is
advertised or left behind (L3), that step 1 is still committed and intact (L2) and restores bit-exact
(L1), and that the next save (step 3) commits and restores. ``recovery_s`` runs from the fault to step 3
restored bit-exact.

How the disk fails (all real system calls of the local tier, failed by
:class:`harness.write_faults.FaultyDisk` with an errno, no root needed; the ``tmpfs`` variants
mount a real small tmpfs, as root only, and record ``not_runnable`` where mounting is refused):

- row 5: ``fsync`` (or the directory's fsync) returns EIO on a data file, the index, the manifest or the
  step directory, drawn from the seed; the failed fsync zeroes the file's unsynced bytes (Linux drops
  dirty pages), so a retry-then-trust would restore wrong bytes;
- row 6: the disk runs out of space after a byte budget drawn from the seed (the last write partial), and
  on a real 64 MiB tmpfs filled up to a drawn free space;
- row 7: the file system turns read-only (EROFS) or the quota runs out (EDQUOT) at a drawn call of the
  save (an open, write, rename or fsync) and stays so; an in-process daemon watching the root must report
  its local tier as degraded (status document and ``ckptd_tier_degraded``) and healthy again once the
  disk recovers. As root, a real tmpfs remounted read-only between two saves (a remount with files open
  for writing is refused with EBUSY, so the mid-save case is the errno one): the save fails typed, and a
  restarted job's manager still opens the read-only root and restores;
- row 18: two gloo ranks, an EIO on rank 1's data-file write: every rank learns of it, nothing is
  committed, the next save commits on both.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ckptd.config import override
from ckptd.errors import CkptdError, DiskFullError, StorageError
from ckptd.format.layout import step_dir
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness import invariants as inv
from harness.fixtures import mounted_tmpfs
from harness.matrix import Outcome, RunContext, not_runnable, row
from harness.workloads import synthetic_state
from harness.write_faults import DiskWithBudget, ErrnoRule, FaultyDisk

STATE_BYTES = 192 * 1024
CHUNK_BYTES = 16 * 1024
WORKLOAD = inv.SyntheticWorkload(STATE_BYTES)
GOOD, FAILED, NEXT = 1, 2, 3


# --- the shape every single-rank scenario shares ------------------------------------------------------

@contextmanager
def _settings(ctx: RunContext) -> Iterator[str]:
    """Small chunks, 1-3 writer threads (so 1-3 parallel data files) and a codec, drawn from the seed."""
    codec = ctx.rng.choice(["raw", "zstd"])
    with override(chunk_bytes=CHUNK_BYTES, io_threads=ctx.rng.randint(1, 3)):
        yield codec


def _manager(root: Path, codec: str) -> CheckpointManager:
    return CheckpointManager(root, policy=Policy(keep_local=1), capture_rng=False, codec=codec, daemon="off")


def _save(root: Path, codec: str, step: int) -> None:
    with _manager(root, codec) as manager:
        manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
        manager.wait()


def dry_run_calls(ctx: RunContext, codec: str) -> FaultyDisk:
    """Save a step into a scratch root through a fault-free :class:`FaultyDisk`: how many bytes and calls of
    each operation a save makes (what a rule's ``skip`` and a budget are drawn from)."""
    counter = FaultyDisk()
    with _manager(ctx.path("dry-run"), codec) as manager, counter:  # the manager opens outside, as below
        manager.save(FAILED, synthetic_state(FAILED, STATE_BYTES), force=True)
        manager.wait()
    return counter


def check_typed(error: CkptdError | None, disk: FaultyDisk | None, kind: type[CkptdError],
                words: tuple[str, ...]) -> inv.Check:
    """L4: the save failed with ``kind`` naming step 2, the local tier and a file of step 2, saying ``words``."""
    if disk is not None and not disk.injected:
        return inv.Check("L4", False, "the fault was never injected: the save no longer reaches the failed call")
    if error is None:
        return inv.Check("L4", False, f"the save of step {FAILED} succeeded on a failing disk")
    text = str(error)
    wrong = []
    if not isinstance(error, kind):
        wrong.append(f"{type(error).__name__} is no {kind.__name__}")
    if error.step != FAILED or error.tier != "local":
        wrong.append(f"names step {error.step} and tier {error.tier}")
    if step_dir(FAILED) not in text:
        wrong.append("names no file of the step")
    wrong += [f"does not say {word!r}" for word in words if word not in text]
    if wrong:
        return inv.Check("L4", False, f"the save's error {'; '.join(wrong)}: {text}")
    return inv.Check("L4", True, f"{type(error).__name__}: {text[:160]}")


def check_step_gone(root: Path) -> inv.Check:
    """L3: the failed step left no file behind (its temporaries and renamed files are removed)."""
    left = sorted(path.name for path in (root / step_dir(FAILED)).glob("*"))
    if left:
        return inv.Check("L3", False, f"the failed step {FAILED} left {left[:5]} in {root}")
    return inv.Check("L3", True, f"nothing of step {FAILED} left")


def failed_save_outcome(ctx: RunContext, root: Path, codec: str, kind: type[CkptdError], words: tuple[str, ...],
                        *, disk: FaultyDisk | None = None, during: Callable[[], list[inv.Check]] | None = None,
                        repair: Callable[[], None] | None = None, after: Callable[[], list[inv.Check]] | None = None,
                        detail: str = "") -> Outcome:
    """With step 1 committed in ``root``: save step 2 while the disk fails (``disk`` installed, or the file
    system failing by itself when None), check L1-L4, ``repair`` the disk, and check that step 3 saves and
    restores. ``during``/``after``: more checks made while the disk still fails and once it works again
    (a daemon's report)."""
    before = inv.record_committed(root)
    ctx.stopwatch.fault()
    error: CkptdError | None = None
    extra: list[inv.Check] = []
    manager = _manager(root, codec)
    try:
        with disk if disk is not None else nullcontext():
            try:
                manager.save(FAILED, synthetic_state(FAILED, STATE_BYTES), force=True)
                manager.wait()
            except CkptdError as failure:
                error = failure
            if during is not None:
                extra = during()
    finally:
        manager.close()
    checks = [check_typed(error, disk, kind, words), *extra,
              inv.check_nothing_partial(root, allowed=[GOOD]), inv.check_no_temporaries(root), check_step_gone(root),
              inv.check_nothing_lost(before, root), inv.check_newest_restores(WORKLOAD, root, expected_step=GOOD)]
    if repair is not None:
        repair()
    _save(root, codec, NEXT)
    recovered = inv.check_newest_restores(WORKLOAD, root, expected_step=NEXT)
    checks.append(recovered)
    recovery = ctx.stopwatch.since_fault() if recovered.ok else None
    checks += after() if after is not None else []
    injected = disk.injected[:1] if disk is not None else "by the file system"
    return inv.outcome(checks, recovery_s=recovery, detail=f"{detail}; codec {codec}; injected {injected}")


# --- row 5: fsync returns EIO ---------------------------------------------------------------------------

#: (file of step 2 whose fsync fails, directory fsyncs let through first): a data file, the index, the
#: manifest, or the step directory when the index is committed (0) or when the manifest is (1).
FSYNC_TARGETS = (("rank-00000*data", 0), ("rank-00000.index.json", 0), ("manifest.json", 0), (".", 0), (".", 1))


@row(5, "fsync returns EIO", short_runs=2)
def fsync_eio_mid_save(ctx: RunContext) -> Outcome:
    root = ctx.path("local")
    with _settings(ctx) as codec:
        _save(root, codec, GOOD)
        name, skip = ctx.rng.choice(FSYNC_TARGETS)
        disk = FaultyDisk(rules=[ErrnoRule("fsync", errno.EIO, step=FAILED, name=name, skip=skip)])
        return failed_save_outcome(ctx, root, codec, StorageError, ("fsync", "Input/output error"), disk=disk,
                                   detail=f"fsync of {name} (skip {skip})")


# --- row 6: ENOSPC --------------------------------------------------------------------------------------

@row(6, "ENOSPC mid-save (errno variant: a byte budget)", short_runs=2)
def disk_full_mid_save(ctx: RunContext) -> Outcome:
    root = ctx.path("local")
    with _settings(ctx) as codec:
        _save(root, codec, GOOD)
        total = dry_run_calls(ctx, codec).written
        budget = ctx.rng.randint(0, total - 64)  # the manifest, written last, is a few hundred bytes
        return failed_save_outcome(ctx, root, codec, DiskFullError, ("disk full",), disk=DiskWithBudget(budget),
                                   detail=f"space for {budget} of {total} bytes")


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0:
        return False
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptd-mount-probe-") as probe:
        with mounted_tmpfs(Path(probe) / "mnt", "1m") as mounted:
            return mounted


MOUNTS = _can_mount_tmpfs()
TMPFS_SIZE = "64m"


def _free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


if MOUNTS:
    @row(6, "ENOSPC mid-save (real 64 MiB tmpfs, root only)", short_runs=1)
    def disk_full_on_a_real_tmpfs(ctx: RunContext) -> Outcome:
        mount_point = ctx.workdir / "tmpfs"
        with mounted_tmpfs(mount_point, TMPFS_SIZE) as mounted:
            if not mounted:
                return Outcome(held=False, checked=("L1",), detail="mounting the tmpfs failed this time")
            root = mount_point / "local"
            with _settings(ctx) as codec:
                _save(root, codec, GOOD)
                need = sum(path.stat().st_size for path in (root / step_dir(GOOD)).iterdir())
                leave = ctx.rng.randint(0, max(0, need - 4096))
                filler = mount_point / "filler"
                with open(filler, "wb") as handle:  # fill the tmpfs up to ``leave`` free bytes
                    handle.write(bytes(max(0, _free_bytes(mount_point) - leave)))
                left = _free_bytes(mount_point)
                return failed_save_outcome(ctx, root, codec, DiskFullError, ("disk full",), repair=filler.unlink,
                                           detail=f"tmpfs with {left} bytes free")
else:
    not_runnable(6, "ENOSPC mid-save (real 64 MiB tmpfs)", reason="mounting a tmpfs needs root (and a sandbox that "
                 "allows mount); this run was refused", covered_by="row 6 errno variant disk_full_mid_save (a byte "
                 "budget on the real write calls) and tests/test_faults_enospc.py")


# --- row 7: EROFS and EDQUOT ---------------------------------------------------------------------------

ROOT_NAME = "run"


def start_daemon(ctx: RunContext, root: Path) -> Any:
    """An in-process daemon watching ``root`` (no object tier; its own maintenance pass 10 s away, so that
    only the scenario's explicit probes run while the disk fails)."""
    from ckptd.daemon.config import load_config
    from ckptd.daemon.service import Daemon

    config = load_config(None, {"state_dir": str(ctx.path("daemon-state")), "node_id": "matrix",
                                "listen": "127.0.0.1:0", "watch": "poll", "poll_interval_s": 10.0, "scrub_interval_s": 0, "name": ROOT_NAME,
                                "local": str(root), "remote": None}, {})
    daemon = Daemon(config)
    daemon.start()
    return daemon


def check_daemon_reports(daemon: Any, degraded: bool) -> inv.Check:
    """L4 (the fault is reported, typed): the daemon's status document and ``ckptd_tier_degraded`` say
    whether the root's local tier is degraded, with the reason."""
    daemon.check_local_tiers()
    health = daemon.status()["roots"][ROOT_NAME]["tiers"]["local"]["health"] or {}
    metrics = daemon.metrics.render()[0].decode()
    gauge = f'ckptd_tier_degraded{{root="{ROOT_NAME}",tier="local"}} {1.0 if degraded else 0.0}'
    wanted = "degraded" if degraded else "ok"
    if health.get("state") != wanted or gauge not in metrics or (degraded and not health.get("reason")):
        return inv.Check("L4", False, f"the daemon reports the local tier as {health} (wanted {wanted}); "
                                      f"gauge {gauge!r} {'present' if gauge in metrics else 'absent'}")
    return inv.Check("L4", True, f"daemon: local tier {wanted} ({health.get('reason')})")


#: Operations that fail once the file system is read-only, or once the quota is spent.
FAILING = {errno.EROFS: ("open", "write", "rename", "fsync"), errno.EDQUOT: ("open", "write")}
WORDS = {errno.EROFS: (StorageError, ("read-only",)), errno.EDQUOT: (DiskFullError, ("quota exceeded",))}


@row(7, "EROFS / EDQUOT mid-save (errno variant), daemon reports degraded", short_runs=2)
def read_only_or_quota_mid_save(ctx: RunContext) -> Outcome:
    root = ctx.path("local")
    code = ctx.rng.choice(sorted(FAILING))
    with _settings(ctx) as codec:
        _save(root, codec, GOOD)
        operation = ctx.rng.choice(FAILING[code])
        calls = dry_run_calls(ctx, codec).calls[operation]
        skip = ctx.rng.randrange(calls)
        # from that call on, every call of the kind fails, anywhere on the disk, until it is repaired
        disk = FaultyDisk(rules=[ErrnoRule(operation, code, skip=skip, times=None)])
        daemon = start_daemon(ctx, root)
        try:
            kind, words = WORDS[code]
            return failed_save_outcome(ctx, root, codec, kind, words, disk=disk,
                                       during=lambda: [check_daemon_reports(daemon, True)],
                                       after=lambda: [check_daemon_reports(daemon, False)],
                                       detail=f"{errno.errorcode[code]} from {operation} call {skip + 1} of {calls}")
        finally:
            daemon.stop(5.0)


def _mount(*options: str) -> None:
    subprocess.run(["mount", *options], check=True, capture_output=True, timeout=30)


def check_probe(root: Path, degraded: bool) -> inv.Check:
    """L4: the daemon's probe of a local tier (:func:`ckptd.daemon.tier_health.probe_local`) says degraded."""
    from ckptd.daemon.tier_health import probe_local
    from ckptd.tiers.local import LocalTier

    tier = LocalTier(root, create=False)
    try:
        health = probe_local(tier)
    finally:
        tier.close()
    ok = health.degraded == degraded and (not degraded or bool(health.reason))
    return inv.Check("L4", ok, f"the daemon's probe: {health.state} ({health.reason})")


if MOUNTS:
    @row(7, "EROFS (a real tmpfs remounted read-only between saves, root only)", short_runs=1)
    def read_only_remount(ctx: RunContext) -> Outcome:
        """No daemon runs here: its root lock is a file open for writing, and a remount with one is refused
        (EBUSY); the daemon's own probe function is checked instead."""
        mount_point = ctx.workdir / "tmpfs"
        with mounted_tmpfs(mount_point, TMPFS_SIZE) as mounted:
            if not mounted:
                return Outcome(held=False, checked=("L1",), detail="mounting the tmpfs failed this time")
            root = mount_point / "local"
            with _settings(ctx) as codec:
                _save(root, codec, GOOD)
                before = inv.record_committed(root)
                ctx.stopwatch.fault()
                _mount("-o", "remount,ro", str(mount_point))
                try:
                    error: CkptdError | None = None
                    try:
                        _save(root, codec, FAILED)
                    except CkptdError as failure:
                        error = failure
                    checks = [check_typed(error, None, StorageError, ("read-only",)), check_probe(root, True),
                              inv.check_nothing_partial(root, allowed=[GOOD]), inv.check_nothing_lost(before, root),
                              # a restarted job's manager opens the read-only root and restores
                              inv.check_newest_restores(WORKLOAD, root, expected_step=GOOD)]
                finally:
                    _mount("-o", "remount,rw", str(mount_point))
                _save(root, codec, NEXT)
                recovered = inv.check_newest_restores(WORKLOAD, root, expected_step=NEXT)
                checks += [recovered, check_probe(root, False)]
            return inv.outcome(checks, recovery_s=ctx.stopwatch.since_fault() if recovered.ok else None,
                               detail=f"codec {codec}")
else:
    not_runnable(7, "EROFS (a real read-only remount)", reason="mounting a tmpfs needs root (and a sandbox that "
                 "allows mount); this run was refused", covered_by="row 7 errno variant read_only_or_quota_mid_save "
                 "(EROFS/EDQUOT on the real open/write/rename/fsync calls)")


# --- row 18: a background write error on one rank -----------------------------------------------------

@row(18, "Background write error on one rank (2 gloo ranks, EIO on rank 1's data write or fsync)", short_runs=1,
     long_runs=20)
def write_error_on_one_rank(ctx: RunContext) -> Outcome:
    from ckptd.testing.multirank import run_multirank
    from harness.rank_faults import save_through_a_fault

    root = ctx.path("local")
    skip, codec, threads = ctx.rng.randrange(4), ctx.rng.choice(["raw", "zstd"]), ctx.rng.randint(1, 3)
    operation = ctx.rng.choice(["write", "fsync"])  # drawn last: earlier seeds keep their other draws
    skip = skip if operation == "write" else 0
    ctx.stopwatch.fault()
    rule = ErrnoRule(operation, errno.EIO, step=FAILED, name="rank-00001*data", skip=skip)
    results = run_multirank(save_through_a_fault, 2, str(root), 1, rule, STATE_BYTES, CHUNK_BYTES, codec, threads,
                            timeout_s=90)
    checks = []
    if not results[1]["injected"]:
        checks.append(inv.Check("L4", False, "rank 1's write never failed: the fault was not injected"))
    for rank, result in enumerate(results):
        told = "step 2" in result["failure"] and "rank 1" in result["failure"]
        checks.append(inv.Check("L4", told, f"rank {rank} learnt: {result['failure'][:200] or 'nothing'}"))
        checks.append(inv.Check("L3", result["after_failure"] == [GOOD],
                                f"rank {rank} lists {result['after_failure']} after the failed save"))
        checks.append(inv.Check("L2", GOOD in result["after_failure"], f"rank {rank}: step {GOOD} kept until a commit"))
        exact = result["restored"] == NEXT and not result["differences"] and result["committed"] == [NEXT]
        checks.append(inv.Check("L1", exact, f"rank {rank} restored step {result['restored']} of "
                                             f"{result['committed']}: {result['differences'] or 'bit-exact'}"))
    checks += [inv.check_nothing_partial(root, allowed=[NEXT]), inv.check_no_temporaries(root)]
    recovery = max(result["recovery_s"] for result in results)
    return inv.outcome(checks, recovery_s=recovery, detail=f"rank 1 {operation} {skip + 1} failed; codec {codec}")
