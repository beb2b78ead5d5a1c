"""Fault-matrix row 30: clock skew of about 20 minutes on a promoter or on a collector (GC).

The skew is injected inside this process (libfaketime is not installed here):
:func:`harness.clock_skew.skewed_clock` wraps ``time.time`` (every wall-clock read of ckptd) and, for
requests, botocore's signing clock. The object store (moto's server) runs in its own process on the true
clock; in front of it, :class:`ckptd.testing.fault_proxy.FaultProxy` with ``check_skew=True`` refuses a
request signed more than 15 minutes off with 403 RequestTimeTooSkewed, as AWS does (moto does not).

- ``skewed_promoter_is_refused``: a promotion signed 16-30 minutes ahead or behind (drawn) fails with a
  typed error naming the tier's URL and saying to check the clock, after a bounded number of refused
  requests (measured; botocore does not retry a 403), and commits nothing on S3; once the clock is right
  the same promotion commits and the step restores from S3 alone (``recovery_s``: fault to restorable).
- ``skewed_collector_spares_live_work``: a collector whose clock runs 16-30 minutes ahead or behind, or a
  promoter whose clock does (drawn), with ``gc_abandoned_s`` drawn below the skew: the collection must not
  abort a live multipart upload of another host, delete a step whose promotion is in flight, or touch a
  committed step, and a lease taken by a collector whose clock runs behind must still look fresh to a
  promoter with a true clock (else promoters would skip chunks the collection deletes).

Both are out of the short mode (``short_runs=0``: 10-30 s a run against moto on a loaded machine):
``tests/test_clock_skew.py`` checks every one of these behaviours in the default run, with fixed skews.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, TierMisconfiguredError
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.promotion import promote_step
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.lease import gc_lease, lease_is_fresh
from harness import invariants as inv
from harness.clock_skew import skewed_clock
from ckptd.testing.fault_proxy import FaultProxy
from harness.matrix import Outcome, RunContext, S3Location, row
from harness.workloads import synthetic_state
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import UploadOwner, new_record_path

STATE_BYTES = 64 * 1024
WORKLOAD = inv.SyntheticWorkload(STATE_BYTES)
#: Refused requests a skewed promotion may cost before it gives up (it costs one: a 403 is not retried).
MAX_REFUSED = 3


def _skew_s(ctx: RunContext) -> float:
    return ctx.rng.choice([1, -1]) * ctx.rng.uniform(16 * 60, 30 * 60)


def _commit_local(root: Path, steps: list[int]) -> LocalTier:
    with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
        for step in steps:
            manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
    return LocalTier(root)


def _tier(location: S3Location, options: dict[str, Any] | None = None) -> ObjectTier:
    return ObjectTier(location.url, storage_options=options or location.storage_options)


@row(30, "Clock skew ~20 min on a promoter: RequestTimeTooSkewed reported, bounded retries", short_runs=0,
     long_runs=20)
def skewed_promoter_is_refused(ctx: RunContext) -> Outcome:
    skew = _skew_s(ctx)
    local = _commit_local(ctx.path("local"), [1])
    remote = ctx.s3()
    before = inv.record_committed(ctx.workdir / "local")
    checks: list[inv.Check] = []
    with FaultProxy(remote.endpoint_url, check_skew=True) as proxy:
        skewed = _tier(remote, proxy.storage_options(remote.storage_options))
        error: CkptdError | None = None
        try:
            ctx.stopwatch.fault()
            with skewed_clock(skew, signing=True):
                try:
                    promote_step(local, skewed, 1)
                except CkptdError as failure:
                    error = failure
            refused = proxy.counts["skewed"]
            text = str(error)
            named = isinstance(error, TierMisconfiguredError) and "check the clock" in text and remote.url in text \
                and ("ahead of" if skew > 0 else "behind") in text
            checks.append(inv.Check("L4", named, f"{skew / 60:+.1f} min: {type(error).__name__}: {text[:220]}"))
            checks.append(inv.Check("L4", 0 < refused <= MAX_REFUSED, f"{refused} request(s) refused as skewed"))
            checks.append(inv.check_nothing_partial(remote, allowed=[]))
            promote_step(local, skewed, 1)  # the clock is right again
        finally:
            skewed.close()
            local.close()
    restored = inv.check_newest_restores(WORKLOAD, None, remote=remote, expected_step=1, scratch=ctx.workdir)
    recovery = ctx.stopwatch.since_fault() if restored.ok else None
    checks += [restored, inv.check_nothing_lost(before, ctx.workdir / "local")]
    return inv.outcome(checks, recovery_s=recovery, detail=f"skew {skew / 60:+.1f} min, {refused} refused")


def _live_upload(tier: ObjectTier, location: S3Location, path: str, refreshed: float) -> str:
    """A multipart upload of ``path`` in flight, owned by a live promoter on another host whose clock
    stamped its record ``refreshed``; returns the upload id."""
    import boto3

    owner = UploadOwner(key=path, host="another-host", pid=1, refreshed=refreshed, lease_s=120.0)
    tier.write_bytes(new_record_path(path), owner.to_json_bytes())
    client = boto3.client("s3", endpoint_url=location.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return str(client.create_multipart_upload(Bucket=tier.bucket, Key=tier.key(path))["UploadId"])


@row(30, "Clock skew ~20 min on a collector or promoter: GC and leases spare live work", short_runs=0,
     long_runs=20)
def skewed_collector_spares_live_work(ctx: RunContext) -> Outcome:
    skew = _skew_s(ctx)
    skewed_one = ctx.rng.choice(["collector", "promoter"])
    threshold = ctx.rng.uniform(60.0, abs(skew) - 60.0)  # gc_abandoned_s below the skew
    local = _commit_local(ctx.path("local"), [1, 2])
    location = ctx.s3()
    remote = _tier(location)
    try:
        promote_step(local, remote, 1)
        index = "step-000000000002/rank-00000.index.json"  # step 2's promotion is in flight
        remote.write_bytes(index, local.read_bytes(index))
        promoter_clock = time.time() + (skew if skewed_one == "promoter" else 0.0)
        upload = _live_upload(remote, location, "chunks/ab/abcdef", promoter_clock)
        before = inv.record_committed(location)
        ctx.stopwatch.fault()
        with skewed_clock(skew if skewed_one == "collector" else 0.0):
            report = collect_garbage(remote, abandoned_after_s=threshold)
        uploads = [found[1] for found in remote.incomplete_uploads()]
        checks = [
            inv.Check("L2", report.aborted_uploads == 0 and uploads == [upload],
                      f"live upload {'kept' if uploads == [upload] else 'aborted'} ({report.aborted_uploads} aborted)"),
            inv.Check("L2", report.abandoned_steps == () and remote.exists(index),
                      f"in-flight step 2: abandoned {report.abandoned_steps}, in flight {report.in_flight_steps}"),
            inv.Check("L2", report.deleted_steps == (), f"deleted committed steps {report.deleted_steps}"),
            inv.check_nothing_lost(before, location),  # step 1 still committed and verifying, chunk by chunk
        ]
        listed = inv.advertised_steps(location)
        checks.append(inv.Check("L3", listed == [1], f"S3 advertises {listed} (only step 1 is committed)"))
        lease = gc_lease(remote)
        with skewed_clock(-abs(skew)):  # a collector whose clock runs behind takes the lease
            lease.__enter__()
        try:
            fresh = lease_is_fresh(remote)
        finally:
            lease.__exit__(None, None, None)
        checks.append(inv.Check("L2", fresh, f"a lease written {abs(skew) / 60:.1f} min behind looks "
                                             f"{'fresh' if fresh else 'expired'} to a true clock"))
    finally:
        remote.close()
        local.close()
    return inv.outcome(checks, detail=f"{skewed_one} {skew / 60:+.1f} min, gc_abandoned_s {threshold:.0f}")
