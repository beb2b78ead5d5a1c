"""Clock skew of +-20 minutes (fault matrix row 30).

(a) A request signed with a clock 20 minutes off is refused by S3 with 403 RequestTimeTooSkewed (the fault
proxy's skew mode does what AWS does; moto does not check): the promotion fails at once with an error that
names the tier and its URL and says to check the clock, after one refused request (botocore does not retry
a 403), and commits nothing.

(b) GC and leases never act on a wall clock alone: with this process's ``time.time`` shifted by +-20
minutes (:func:`harness.clock_skew.skewed_clock`; libfaketime is not installed here), a collector
does not abort a live multipart upload, does not delete an in-flight step, never deletes a committed step,
and a lease taken by a collector whose clock runs behind still holds promoters back. Ages are the store's
clock (its ``Date``) minus times the store stamped (``LastModified``); the control case shows that a
really stale owner record is still judged dead.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.errors import TierMisconfiguredError
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.promotion import promote_step
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.lease import gc_lease, lease_is_fresh
from harness.clock_skew import skewed_clock
from ckptd.testing.fault_proxy import FaultProxy
from harness.workloads import synthetic_state
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import UploadOwner, new_record_path

pytestmark = pytest.mark.s3
SKEWS = [20 * 60, -20 * 60]


@pytest.fixture
def remote(s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[ObjectTier]:
    tier = ObjectTier(f"s3://{s3_bucket}/run", storage_options=s3_options)
    yield tier
    tier.close()


def _committed_local(root: Path, steps: list[int]) -> LocalTier:
    with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
        for step in steps:
            manager.save(step, synthetic_state(step, 64 * 1024), force=True)
    return LocalTier(root)


# --- (a) a skewed request --------------------------------------------------------------------------------

def test_a_skewed_request_is_reported_as_a_clock_problem_without_retries(
        tmp_path: Path, s3_server: Any, s3_bucket: str, remote: ObjectTier) -> None:
    """Ahead and behind: refused once each, reported as a clock problem, nothing stored; a request within
    the allowed 15 minutes then goes through and commits."""
    local = _committed_local(tmp_path / "local", [1])
    url = f"s3://{s3_bucket}/run"
    with FaultProxy(s3_server.endpoint_url, check_skew=True) as proxy:
        skewed = ObjectTier(url, storage_options=proxy.storage_options(s3_server.storage_options))
        try:
            for refused, skew_s in enumerate(SKEWS, start=1):
                with skewed_clock(skew_s, signing=True), pytest.raises(TierMisconfiguredError) as caught:
                    promote_step(local, skewed, 1)
                text = str(caught.value)
                assert "check the clock" in text and url in text, text
                offset = re.search(r"clock is (\d+) s (ahead of|behind)", text)
                assert offset is not None and abs(int(offset.group(1)) - abs(skew_s)) < 30, text
                assert offset.group(2) == ("ahead of" if skew_s > 0 else "behind"), text
                assert proxy.counts["skewed"] == refused, proxy.counts  # refused once, never retried
                assert remote.committed_steps() == []
                assert remote.list_objects("") == []  # nothing reached the store
            with skewed_clock(10 * 60, wall=False, signing=True):  # within the allowed skew
                promote_step(local, skewed, 1)
        finally:
            skewed.close()
        assert proxy.counts["skewed"] == len(SKEWS) and proxy.counts["requests"] > len(SKEWS)
    assert remote.committed_steps() == [1]


# --- (b) GC and leases under a skewed wall clock ----------------------------------------------------------

def _live_upload(tier: ObjectTier, s3_server: Any, path: str, *, refreshed: float, lease_s: float = 120.0) -> str:
    """A multipart upload of ``path`` in flight, owned by a promoter on another host (its owner record
    written now, stamped ``refreshed`` by that promoter's clock); returns the upload id."""
    import boto3

    owner = UploadOwner(key=path, host="another-host", pid=1, refreshed=refreshed, lease_s=lease_s)
    tier.write_bytes(new_record_path(path), owner.to_json_bytes())
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return str(client.create_multipart_upload(Bucket=tier.bucket, Key=tier.key(path))["UploadId"])


def test_a_skewed_collector_spares_live_work_and_still_aborts_a_dead_upload(
        tmp_path: Path, s3_server: Any, remote: ObjectTier) -> None:
    """One collection by a collector 20 minutes ahead (which would see everything older, were it to trust
    its own clock): it keeps the live upload of a promoter with a true clock and that of a promoter whose
    clock is 20 minutes behind (its record's ``refreshed`` stamp is 40 minutes before the collector's), a
    step whose promotion is in flight and the committed step; the control, an owner record that really
    stopped being refreshed (lease 1 s, over 2.5 s ago on the store's clock, whose stamps have 1 s
    resolution), is judged dead and its upload aborted."""
    dead = _live_upload(remote, s3_server, "chunks/cd/cdef01", refreshed=time.time(), lease_s=1.0)
    stale_since = time.monotonic()
    true_clock = _live_upload(remote, s3_server, "chunks/ab/abcdef", refreshed=time.time())
    behind = _live_upload(remote, s3_server, "chunks/ef/ef0123", refreshed=time.time() - 20 * 60)
    local = _committed_local(tmp_path / "local", [1, 2])
    promote_step(local, remote, 1)
    # step 2's promotion is in flight: its index is up (the in-flight marker), its manifest is not
    index = "step-000000000002/rank-00000.index.json"
    remote.write_bytes(index, local.read_bytes(index))
    time.sleep(max(0.0, 2.5 - (time.monotonic() - stale_since)))
    with skewed_clock(20 * 60):
        report = collect_garbage(remote, abandoned_after_s=10 * 60)
    assert report.aborted_uploads == 1, report
    assert sorted(found[1] for found in remote.incomplete_uploads()) == sorted([true_clock, behind])
    assert dead not in [found[1] for found in remote.incomplete_uploads()]
    assert report.abandoned_steps == () and report.in_flight_steps == (2,), report
    assert report.deleted_steps == () and remote.committed_steps() == [1]
    assert remote.exists(index)


def test_a_lease_taken_by_a_collector_whose_clock_runs_behind_holds(remote: ObjectTier) -> None:
    """The collector's clock is 20 minutes behind (past ``gc_lease_s``, 10 minutes): a promoter with a true
    clock must still see its lease as fresh, or it would skip chunks the collection is deleting."""
    lease = gc_lease(remote)
    with skewed_clock(-20 * 60):
        lease.__enter__()  # the lease object is written under the skewed clock
    try:
        assert lease_is_fresh(remote)
    finally:
        lease.__exit__(None, None, None)
    assert not lease_is_fresh(remote)
