"""Fault-matrix rows 23-26 and 28: the object tier under a faulty store.

Every fault is real: a :class:`~ckptd.testing.fault_proxy.FaultProxy` on loopback between s3fs and moto's
server answers 500/503, stalls, or resets a connection mid-body; a listener whose accept queue is full
makes connections time out; an exception is raised inside the real multipart upload (botocore's
``before-send`` hook of the tier's own clients). Afterwards the bucket is listed with a plain boto3
client (:func:`harness.s3_scenarios.look_behind`), so a partial object or an open multipart upload
ckptd's own listing would hide is still seen, and the committed step is restored from the object tier
alone in a fresh process (:func:`harness.invariants.check_newest_restores`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ckptd.config import override
from ckptd.errors import CkptdError, TierUnreachableError, UnpromotedError
from ckptd.format.layout import step_dir
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import KeepEvery, Policy
from ckptd.promotion import promote_step
from ckptd.promotion.contents import read_step_contents, read_stored_chunk
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.testing.fault_proxy import FaultProxy
from harness.invariants import Check, SyntheticWorkload, check_newest_restores, outcome
from harness.matrix import Outcome, RunContext, row
from harness.s3_scenarios import blackhole_endpoint, look_behind, save_steps_locally, warnings_logged
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.s3_transfers import crc32_checksum

MIB = 1024 * 1024
#: A state whose large tensor (6 MiB) is one chunk uploaded in two parts, its small one (2 MiB) one PUT.
MULTIPART = SyntheticWorkload(8 * MIB)
SMALL = SyntheticWorkload(256 * 1024)
#: Chunks up to 16 MiB, parts of 5 MiB (the S3 minimum), short back-off so a run stays short.
LAYOUT = {"chunk_bytes": 16 * MIB, "s3_part_bytes": 5 * MIB}
FAST_BACKOFF = {"s3_backoff_base_s": 0.01, "s3_backoff_max_s": 0.2}
#: A stalled request outlives the client's read timeout many times over; a save held up by the object tier
#: would take at least this long.
STALL_S = 30.0


def _remote_checks(ctx: RunContext, loc: Any, workload: SyntheticWorkload, step: int, *,
                   fresh_process: bool = False) -> list[Check]:
    """L2 (the step is committed on the object tier), L3 (boto3 sees nothing stray, partial or open, and
    every advertised step verifies) and L1 (the step restores bit-exact from the object tier alone, in a
    fresh process with ``fresh_process``)."""
    direct = ObjectTier(loc.url, storage_options=loc.storage_options)
    try:
        committed = direct.committed_steps()
        checks = [Check("L2", committed == [step], f"committed on the object tier: {committed}")]
        found = look_behind(loc.endpoint_url, loc.url, direct)
        checks.append(Check("L3", found.clean, found.describe()))
        problems = [f"step {p.step}: {p.path}: {p.error}" for listed in committed for p in verify_step(direct, listed)]
        restored = check_newest_restores(workload, remote=loc, expected_step=step, fresh_process=fresh_process,
                                         scratch=ctx.workdir)
        lost = 0 if restored.ok and not problems else _committed_bytes(direct, step)
    finally:
        direct.close()
    checks.append(Check("L3", not problems, "; ".join(problems[:3]) or f"step(s) {committed} verify", lost))
    checks.append(restored)
    return checks


def _committed_bytes(tier: ObjectTier, step: int) -> int:
    """Bytes of a step the object tier lists as committed (0 when it lists none): what a broken one loses."""
    try:
        return load_step_manifest(tier, step).total_bytes
    except CkptdError:
        return 0


def _failures(error: BaseException) -> list[BaseException]:
    records = getattr(error, "failures", None)
    return [record.error for record in records] if records else [error]


# --- row 23 --------------------------------------------------------------------------------------

@row(23, "S3 500/503 SlowDown on X% of requests", short_runs=1, long_runs=100)
def slowdown_on_a_fraction(ctx: RunContext) -> Outcome:
    """X% (5-40, from the seed) of requests answer 500 InternalError or 503 SlowDown: promotion succeeds
    within its retry budget (full-jitter back-off), the bucket holds exactly the step's keys and no
    multipart upload, and the step restores bit-exact from S3 alone."""
    fraction = ctx.rng.uniform(0.05, 0.40)
    loc = ctx.s3()
    local = ctx.path("local")
    # the budget is sized for the fault rate: 10 retries per operation, data and metadata clients alike
    budget = dict(LAYOUT, **FAST_BACKOFF, s3_retries=10, s3_metadata_retries=11)
    with override(**budget):
        save_steps_locally(local, MULTIPART, [1])
        with FaultProxy(loc.endpoint_url, fraction=fraction, kinds=("500", "503"),
                        seed=ctx.rng.randrange(2 ** 32)) as proxy:
            remote = ObjectTier(loc.url, storage_options=proxy.storage_options(loc.storage_options))
            ctx.stopwatch.fault()
            try:
                report = promote_step(LocalTier(local), remote, 1)
            finally:
                remote.close()
            recovery = ctx.stopwatch.since_fault()
    checks = [Check("L2", report.chunks_uploaded == report.chunks and not report.already_committed,
                    f"{report.chunks_uploaded} of {report.chunks} chunks uploaded")]
    checks += _remote_checks(ctx, loc, MULTIPART, 1, fresh_process=True)
    return outcome(checks, recovery_s=recovery,
                   detail=f"{fraction:.0%} faulted: {proxy.faults_injected} of {proxy.counts['requests']} requests")


# --- rows 24 and 25: the tier fails, the step stays pending locally, lands once healed -----------------

def _pending_then_healed(ctx: RunContext, proxy: FaultProxy | None, loc: Any, failing_options: dict[str, Any],
                         heal: Any, expect: type[BaseException] | None,
                         failing_settings: dict[str, Any]) -> tuple[list[Check], float | None, str]:
    """Save step 1 through a manager whose object tier fails: the save returns, the promotion fails with
    ``expect`` (when given), the step stays pinned and restorable locally, a warning is logged and the lag
    says the object tier is behind. Then ``heal()``: a restarted manager promotes the pending step.
    Returns the checks, the seconds from the heal to remote-restorable, and a note."""
    local = ctx.path("local")
    checks: list[Check] = []
    policy = Policy(keep_local=None, keep_remote=KeepEvery(1))  # the pending step is never superseded
    with override(**failing_settings), warnings_logged() as logged:  # short timeouts only while it fails
        manager = CheckpointManager(local, remote=loc.url, storage_options=failing_options, capture_rng=False,
                                    policy=policy, daemon="off")
        try:
            started = time.monotonic()
            manager.save(1, SMALL.state(1), force=True)
            manager.wait()
            saved_s = time.monotonic() - started
            try:
                manager.wait_uploads()
                errors: list[BaseException] = []
            except CkptdError as error:
                errors = _failures(error)
            waited_s = time.monotonic() - started
            lag = manager.promotion_lag
            pending = manager.uploader.unpromoted if manager.uploader is not None else []
        except BaseException:
            with contextlib.suppress(CkptdError):
                manager.close()
            raise
        checks.append(Check("L2", saved_s < STALL_S, f"save and local commit took {saved_s:.2f}s: never held up "
                                                     f"by the object tier (bound {STALL_S:.0f}s)"))
        checks.append(Check("L2", bool(errors) and (expect is None or all(isinstance(e, expect) for e in errors)),
                            f"promotion failures: {[type(e).__name__ for e in errors]} (expected {expect})"))
        checks.append(Check("L2", pending == [1], f"steps pending for the object tier: {pending}"))
        checks.append(Check("L2", lag is not None and lag.steps_behind == 1,
                            f"lag: {lag.describe() if lag is not None else None}"))
        alerts = [r for r in logged if r.name.startswith("ckptd.promotion") and "step 1" in r.getMessage()]
        checks.append(Check("L2", bool(alerts), f"{len(alerts)} warning(s) naming step 1 logged"))
        local_copy = check_newest_restores(SMALL, local, expected_step=1, read_only=True)
        checks.append(local_copy)
        heal()
        ctx.stopwatch.fault()  # recovery counts from the heal
        try:
            manager.close()
            closed = "closed without error"
        except UnpromotedError as error:
            closed = f"close: UnpromotedError steps {error.steps}"
        checks.append(Check("L2", "steps (1,)" in closed, closed))
    healed = proxy.storage_options(loc.storage_options) if proxy is not None else loc.storage_options
    with CheckpointManager(local, remote=loc.url, storage_options=healed, capture_rng=False, policy=policy,
                           daemon="off") as restarted:
        restarted.wait_uploads()
    recovery = ctx.stopwatch.since_fault()
    checks += _remote_checks(ctx, loc, SMALL, 1)
    return checks, recovery, f"save+wait {saved_s:.2f}s, failure known after {waited_s:.2f}s"


@row(24, "Persistent 503", short_runs=1, long_runs=100)
def persistent_slowdown(ctx: RunContext) -> Outcome:
    """Every request answers 503 SlowDown: the upload is marked pending (the step stays pinned locally and
    restorable), a warning names the step and the promotion lag shows it; once the proxy heals, the next
    start promotes it. recovery_s: heal to remote-restorable."""
    loc = ctx.s3()
    failing = {**FAST_BACKOFF, "s3_retries": 2, "s3_metadata_retries": 2, "wait_timeout_s": 60.0,
               "close_timeout_s": 60.0}
    with FaultProxy(loc.endpoint_url, fraction=1.0, kinds=("503",), seed=ctx.rng.randrange(2 ** 32)) as proxy:
        options = proxy.storage_options(loc.storage_options)

        def heal() -> None:
            proxy.fraction = 0.0

        checks, recovery, note = _pending_then_healed(ctx, proxy, loc, options, heal, None, failing)
    return outcome(checks, recovery_s=recovery, detail=f"{proxy.counts['503']} requests refused; {note}")


STALL_SETTINGS = {"s3_read_timeout_s": 0.3, "s3_metadata_read_timeout_s": 0.3, "s3_connect_timeout_s": 0.3,
                  "s3_metadata_connect_timeout_s": 0.3, "s3_retries": 1, "s3_metadata_retries": 2,
                  "wait_timeout_s": 60.0, "close_timeout_s": 60.0, **FAST_BACKOFF}


@row(25, "Stalled endpoint (read timeout)", short_runs=1, long_runs=100)
def stalled_endpoint(ctx: RunContext) -> Outcome:
    """The proxy accepts every request and never answers (for longer than the run waits): the read timeout
    fires, the save returns long before the endpoint would have answered, the promotion fails as
    unreachable and stays pending; once healed it lands."""
    loc = ctx.s3()
    with FaultProxy(loc.endpoint_url, fraction=1.0, kinds=("stall",), stall_s=STALL_S,
                    seed=ctx.rng.randrange(2 ** 32)) as proxy:
        failing = proxy.storage_options(loc.storage_options)

        def heal() -> None:
            proxy.fraction = 0.0

        started = time.monotonic()
        checks, recovery, note = _pending_then_healed(ctx, proxy, loc, failing, heal, TierUnreachableError,
                                                      STALL_SETTINGS)
        bounded = time.monotonic() - started
    checks.append(Check("L2", proxy.counts["stall"] > 0, f"{proxy.counts['stall']} request(s) stalled"))
    return outcome(checks, recovery_s=recovery, detail=f"{note}; whole run {bounded:.1f}s, stall {STALL_S}s")


@row(25, "Stalled endpoint (connect timeout)", short_runs=1, long_runs=100)
def unaccepted_connections(ctx: RunContext) -> Outcome:
    """The endpoint's accept queue is full, so new connections are never accepted: the connect timeout
    fires, the save is not held up, the step stays pending; a restart reaching the store (the same bucket
    and prefix through a working endpoint) promotes it."""
    loc = ctx.s3()
    with blackhole_endpoint() as endpoint:
        failing = dict(loc.storage_options)
        failing["client_kwargs"] = dict(loc.storage_options.get("client_kwargs") or {}, endpoint_url=endpoint)
        checks, recovery, note = _pending_then_healed(ctx, None, loc, failing, lambda: None, TierUnreachableError,
                                                      STALL_SETTINGS)
    return outcome(checks, recovery_s=recovery, detail=note)


# --- row 26 --------------------------------------------------------------------------------------

@row(26, "Reset mid-part", short_runs=1, long_runs=100)
def reset_mid_part(ctx: RunContext) -> Outcome:
    """A fraction of uploads (10-35%) has its connection reset after N bytes of the body (N from the seed,
    under one part): every part is retried, and the store's full-object CRC32 of every chunk equals the
    CRC32 of the local bytes; the step verifies and restores bit-exact from S3 alone."""
    fraction = ctx.rng.uniform(0.10, 0.35)
    cut = ctx.rng.randrange(1, 5 * MIB)
    loc = ctx.s3()
    local = ctx.path("local")
    with override(**LAYOUT, **FAST_BACKOFF, s3_retries=10, s3_metadata_retries=11):
        save_steps_locally(local, MULTIPART, [1])
        with FaultProxy(loc.endpoint_url, fraction=fraction, kinds=("cut",), cut_after_bytes=cut,
                        seed=ctx.rng.randrange(2 ** 32)) as proxy:
            remote = ObjectTier(loc.url, storage_options=proxy.storage_options(loc.storage_options))
            ctx.stopwatch.fault()
            try:
                promote_step(LocalTier(local), remote, 1)
            finally:
                remote.close()
            recovery = ctx.stopwatch.since_fault()
    checks = [_checksums_match(loc, LocalTier(local), 1)]
    checks += _remote_checks(ctx, loc, MULTIPART, 1)
    return outcome(checks, recovery_s=recovery, detail=f"{proxy.counts['cut']} of {proxy.counts['requests']} "
                                                       f"requests cut after {cut} body bytes")


def _checksums_match(loc: Any, local: LocalTier, step: int) -> Check:
    """Every chunk's full-object CRC32 kept by the store equals the CRC32 of the local chunk's bytes."""
    remote = ObjectTier(loc.url, storage_options=loc.storage_options)
    try:
        wrong = []
        contents = read_step_contents(local, step)
        for key, (share, chunk) in contents.unique_chunks().items():
            size, _, stored_crc = remote.stored_checksum(remote.chunk_path(key))
            local_crc = crc32_checksum(read_stored_chunk(local, share, chunk))
            if stored_crc != local_crc or size != chunk.length:
                wrong.append(f"{key}: stored {size} B crc {stored_crc}, local {chunk.length} B crc {local_crc}")
    finally:
        remote.close()
    return Check("L1", not wrong, "; ".join(wrong) or f"{len(contents.unique_chunks())} chunk checksums match")


# --- row 28 --------------------------------------------------------------------------------------

class _Injected(RuntimeError):
    """The exception a row-28 scenario raises inside a write."""


@row(28, "Exception while writing a file (streamed pieces)", short_runs=1, long_runs=100)
def exception_in_streamed_write(ctx: RunContext) -> Outcome:
    """``ObjectTier.write_stream`` (the storage plugin's streaming write) whose piece source raises after
    its first piece, for a one-PUT and a multipart size: the exception reaches the caller, nothing is at
    the final key and no multipart upload is left."""
    loc = ctx.s3()
    checks = []
    with override(**LAYOUT):
        tier = ObjectTier(loc.url, storage_options=loc.storage_options)
        try:
            for size in (ctx.rng.randrange(1, MIB), ctx.rng.randrange(6 * MIB, 11 * MIB)):
                path = f"{step_dir(1)}/streamed-{size}.data"

                def pieces(size: int = size) -> Any:
                    yield bytes(ctx.rng.getrandbits(8) for _ in range(min(size, 4096)))
                    raise _Injected(f"the source of {size} bytes failed after its first piece")

                checks.append(_raises(lambda: tier.write_stream(path, size, pieces), f"write_stream of {size} B"))
        finally:
            tier.close()
    found = look_behind(loc.endpoint_url, loc.url, ObjectTier(loc.url, storage_options=loc.storage_options))
    checks.append(Check("L3", found.clean and not found.owner_records, found.describe()))
    return outcome(checks)


@row(28, "Exception while writing a file (multipart, after the first part)", short_runs=1, long_runs=100)
def exception_in_multipart_write(ctx: RunContext) -> Outcome:
    """A multipart upload (3 parts) into which an exception is raised as part K (2 or 3, from the seed) is
    sent, inside the tier's own client: the upload is aborted, the caller gets the failure, nothing is at
    the final key, no multipart upload and no owner record are left; the same write then succeeds."""
    loc = ctx.s3()
    part = ctx.rng.choice([2, 3])
    data = ctx.rng.randbytes(11 * MIB)
    path = f"{step_dir(1)}/rank-00000.data"
    armed = [True]

    def fail_part(request: Any, **_: Any) -> None:
        if armed[0] and f"partNumber={part}" in str(getattr(request, "url", "")):
            raise _Injected(f"raised while part {part} was sent")

    checks = []
    with override(**LAYOUT, s3_concurrency=1):
        tier = ObjectTier(loc.url, storage_options=loc.storage_options)
        try:
            tier.on_request(fail_part)
            checks.append(_raises(lambda: tier.write_bytes(path, data), f"multipart write failing at part {part}"))
            found = look_behind(loc.endpoint_url, loc.url, tier)
            checks.append(Check("L3", found.clean and not found.owner_records, found.describe()))
            armed[0] = False
            tier.write_bytes(path, data)
            same = tier.read_bytes(path) == data
            checks.append(Check("L1", same, "the write after the failed one stored the exact bytes"))
        finally:
            tier.close()
    return outcome(checks, detail=f"exception at part {part}")


def _raises(write: Any, what: str) -> Check:
    try:
        write()
    except (_Injected, CkptdError) as error:
        chained = error if isinstance(error, _Injected) else error.__cause__
        return Check("L3", True, f"{what}: {type(error).__name__} (from {type(chained).__name__})")
    return Check("L3", False, f"{what}: no exception reached the caller")
