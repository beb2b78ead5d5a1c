"""Multipart hygiene: GC knows an abandoned upload by its owner record, not by its age.

A second process plays a promoter with a large upload in flight: it writes through the real object
tier, and a botocore ``before-send`` hook holds its parts back (a slow link), so the upload stays
open while the collector runs. ``CKPTD_HOST_ID`` gives that process another host's identity."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ckptd.config import override
from ckptd.promotion.gc import collect_garbage
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import OWNERS_PREFIX
from test_promotion_support import object_tier, s3_client

pytestmark = pytest.mark.s3
_PART = 5 * 1024 * 1024
_KEY = "chunks/ab/in-flight.raw"

_PROMOTER = r"""
import asyncio, json, os, sys
from ckptd.config import override
from ckptd.tiers.object import ObjectTier

bucket, options = sys.argv[1], json.loads(sys.argv[2])

async def slow_link(**_):
    await asyncio.sleep(3600)

with override(s3_part_bytes=5 * 1024 * 1024, s3_upload_owner_lease_s=6.0, s3_read_timeout_s=3600.0):
    tier = ObjectTier(f"s3://{bucket}/run", storage_options=options)
    tier.connect()
    for client in tier.lanes:
        client._s3.meta.events.register("before-send.s3.UploadPart", slow_link)
    print("uploading", flush=True)
    tier.write_bytes("chunks/ab/in-flight.raw", os.urandom(3 * 5 * 1024 * 1024))
"""


def _start_promoter(s3_bucket: str, s3_options: dict, host_id: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_HOST_ID"}
    if host_id is not None:
        env["CKPTD_HOST_ID"] = host_id
    child = subprocess.Popen([sys.executable, "-c", _PROMOTER, s3_bucket, json.dumps(s3_options)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "uploading"
    return child


def _wait_for_upload(boto, bucket: str, deadline_s: float = 60.0) -> None:
    """Until the child's upload is open and its owner record written (both visible in the store)."""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        uploads = boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        records = boto.list_objects_v2(Bucket=bucket, Prefix=f"run/{OWNERS_PREFIX}/").get("Contents", [])
        if uploads and records:
            return
        time.sleep(0.1)
    raise AssertionError("the child's upload never appeared")


def _open_uploads(boto, bucket: str) -> list[str]:
    return [upload["Key"] for upload in boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()


@contextlib.contextmanager
def _promoter_uploading(s3_server, s3_bucket: str, s3_options: dict,
                        host_id: str | None) -> Iterator[tuple[object, ObjectTier, subprocess.Popen]]:
    """A child promoter (as ``host_id``) with its upload open in the store; killed and closed after."""
    boto = s3_client(s3_server)
    remote = object_tier(s3_bucket, s3_options)
    child = _start_promoter(s3_bucket, s3_options, host_id=host_id)
    try:
        _wait_for_upload(boto, s3_bucket)
        yield boto, remote, child
    finally:
        _kill(child)
        remote.close()


def test_a_live_promoter_on_another_host_keeps_its_upload_until_its_lease_expires(s3_server, s3_bucket,
                                                                                  s3_options):
    with _promoter_uploading(s3_server, s3_bucket, s3_options, "another-host") as (boto, remote, child):
        time.sleep(7.0)  # past the 6 s lease: only the owner's refreshes (every 2 s) keep the record alive
        with override(gc_abandoned_s=0.0):
            report = collect_garbage(remote)
            assert report.aborted_uploads == 0 and _open_uploads(boto, s3_bucket) == [f"run/{_KEY}"], \
                "the upload of a live promoter on another host is left alone, however old"
            _kill(child)  # the host "dies": nobody refreshes the record any more
            assert collect_garbage(remote).aborted_uploads == 0, "its record is still fresh (>= 4 s left)"
            time.sleep(6.5)
            report = collect_garbage(remote)
        assert report.aborted_uploads == 1 and _open_uploads(boto, s3_bucket) == []
        assert not remote.list_objects(OWNERS_PREFIX), "the expired owner record is removed too"


def test_an_upload_whose_owner_on_this_host_died_is_aborted_at_once(s3_server, s3_bucket, s3_options):
    with _promoter_uploading(s3_server, s3_bucket, s3_options, None) as (boto, remote, child):
        assert collect_garbage(remote, abandoned_after_s=3600.0).aborted_uploads == 0, "its owner is alive"
        _kill(child)
        report = collect_garbage(remote, abandoned_after_s=3600.0)
        assert report.aborted_uploads == 1, "a dead pid on this host owns it: aborted though its record is fresh"
        assert _open_uploads(boto, s3_bucket) == [] and not remote.list_objects(OWNERS_PREFIX)


def test_an_upload_without_an_owner_record_falls_back_to_its_age(s3_server, s3_bucket, s3_options):
    boto = s3_client(s3_server)
    remote = object_tier(s3_bucket, s3_options)
    try:
        boto.create_multipart_upload(Bucket=s3_bucket, Key="run/chunks/cd/older-ckptd.raw")
        started = boto.list_multipart_uploads(Bucket=s3_bucket)["Uploads"][0]["Initiated"].timestamp()
        age = time.time() - started
        assert collect_garbage(remote, abandoned_after_s=age + 3600.0).aborted_uploads == 0
        assert collect_garbage(remote, abandoned_after_s=max(0.0, age - 1.0)).aborted_uploads == 1
        assert _open_uploads(boto, s3_bucket) == []
    finally:
        remote.close()


def test_an_upload_that_finishes_while_the_collector_looks_is_no_error(s3_server, s3_bucket, s3_options):
    boto = s3_client(s3_server)
    remote = object_tier(s3_bucket, s3_options)
    key = "run/chunks/ef/finishing.raw"
    upload_id = boto.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
    listed = remote.incomplete_uploads

    def listed_then_finished() -> list[tuple[str, str, float]]:
        found = listed()
        boto.abort_multipart_upload(Bucket=s3_bucket, Key=key, UploadId=upload_id)  # its writer finishes it
        return found

    remote.incomplete_uploads = listed_then_finished
    try:
        assert remote.abort_incomplete_uploads(0.0) == 0, "an upload gone since the listing is not counted"
        assert _open_uploads(boto, s3_bucket) == []
    finally:
        remote.close()


def test_a_record_from_another_pid_namespace_of_this_host_name_is_judged_by_its_lease_only():
    """Containers that share a host name cannot see each other's pids: a pid missing here proves
    nothing about a record written in another pid namespace."""
    import socket

    from ckptd.tiers.upload_owners import UploadOwner, this_host

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fresh = time.time()
    mine = UploadOwner(key=_KEY, host=this_host(), pid=gone.pid, refreshed=fresh, lease_s=3600.0)
    assert not mine.is_alive(), "a dead pid in this namespace: its upload is abandoned"
    if os.path.exists("/proc/self/ns/pid"):
        neighbour = UploadOwner(key=_KEY, host=socket.gethostname(), pid=gone.pid, refreshed=fresh, lease_s=3600.0)
        assert neighbour.is_alive(), "same host name, another pid namespace: alive while its lease lasts"
