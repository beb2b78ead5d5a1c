"""A dead writer's pid taken by a later process (a restarted daemon in a container is pid 1 again; a
machine with pid_max 32768 reuses pids within minutes) keeps neither its multipart upload nor its GC lease
alive: owner records and leases name the start of their process, not only its pid (fault matrix row 29,
seed 2900100: the restarted daemon waited for the lease of an upload whose dead owner's pid was reused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ckptd.config import override
from ckptd.promotion import lease
from ckptd.tiers.upload_owners import UploadOwner, key_directory, process_exists, process_start, this_host
from test_promotion_support import object_tier, s3_client

_KEY = "chunks/ab/reused-pid.raw"
linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process starts are read from /proc")


@linux_proc
def test_a_process_start_tells_a_reused_pid_from_its_first_owner() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start(child.pid)
        assert started and started != process_start(os.getpid())
        assert process_exists(child.pid, started), "the same start of the process: alive"
        assert not process_exists(child.pid, started + "0"), "another start under the same pid: not the owner"
        assert process_exists(child.pid), "a record without a start (older ckptd): the pid alone counts"
    finally:
        child.kill()
        child.wait()
    assert not process_exists(child.pid, started)


@linux_proc
def test_an_upload_whose_owner_pid_was_reused_is_aborted_at_once(s3_server, s3_bucket: str, s3_options: dict) -> None:
    """The record names this host and a pid that runs (this very process, as for a restarted daemon that
    got its predecessor's pid) but another start of it: the upload is abandoned although its lease is
    fresh; the same record with this process's own start keeps it."""
    remote = object_tier(s3_bucket, s3_options, prefix="reuse")
    boto = s3_client(s3_server)
    try:
        remote.connect()
        key = remote.key(_KEY)
        upload = boto.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
        fresh = time.time()
        dead = UploadOwner(key=_KEY, host=this_host(), pid=os.getpid(), refreshed=fresh, lease_s=3600.0,
                           started="another-boot:1")
        live = UploadOwner.mine(_KEY)
        assert live.started == process_start(os.getpid()) and UploadOwner.from_json_bytes(live.to_json_bytes()) == live
        record = f"{key_directory(_KEY)}/reused.json"
        remote.write_bytes(record, live.to_json_bytes())
        assert remote.abandoned_uploads(0.0) == [], "its own process's start: a live owner"
        remote.write_bytes(record, dead.to_json_bytes())
        abandoned = remote.abandoned_uploads(0.0)
        assert [(path, upload_id) for path, upload_id, _ in abandoned] == [(_KEY, upload)], abandoned
        assert "its owner is gone" in abandoned[0][2]
        assert remote.abort_incomplete_uploads(0.0) == 1
        left = boto.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        assert [u["UploadId"] for u in left if u["Key"] == key] == []
    finally:
        remote.close()


@linux_proc
def test_a_gc_lease_whose_owner_pid_was_reused_counts_as_ended(tmp_path) -> None:
    """A lease of another collector process on this host: fresh while that start of its pid runs, ended
    once the pid belongs to another start (the collector died and something else got its pid)."""
    from ckptd.tiers.local import LocalTier

    tier = LocalTier(tmp_path)
    collector = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        body = {"owner": "x", "host": this_host(), "pid": collector.pid, "created": time.time(), "token": "t"}
        with override(gc_lease_s=3600.0):
            tier.write_bytes(lease.LEASE_PATH, json.dumps({**body, "started": process_start(collector.pid)}).encode())
            assert lease.lease_is_fresh(tier), "the collector that took the lease runs: fresh"
            tier.write_bytes(lease.LEASE_PATH, json.dumps({**body, "started": "another-boot:1"}).encode())
            assert not lease.lease_is_fresh(tier), "its pid now belongs to another process: the lease ended"
            tier.write_bytes(lease.LEASE_PATH, json.dumps(body).encode())
            assert lease.lease_is_fresh(tier), "an older lease without a start: the running pid counts"
    finally:
        collector.kill()
        collector.wait()


def test_an_upload_whose_abort_did_not_land_keeps_its_owner_record(s3_server, s3_bucket: str,
                                                                   s3_options: dict) -> None:
    """A part fails and the abort that follows is refused too (as when a draining daemon's uploads are
    cancelled): the upload stays open on the store, so its owner record stays with it (before, the record
    was deleted and the orphan upload waited gc_abandoned_s as one without a record); a collector then
    finds its owner and aborts it once that owner is gone. A failed upload whose abort landed leaves no
    record."""
    from ckptd.errors import CkptdError
    from ckptd.tiers.upload_owners import OWNERS_PREFIX

    boto = s3_client(s3_server)

    async def refuse(**_: object) -> None:  # botocore's before-send: the request never leaves
        raise ConnectionResetError("injected")

    for refused, record_kept in (({"UploadPart", "AbortMultipartUpload"}, True), ({"UploadPart"}, False)):
        prefix = f"abort-{len(refused)}"
        with override(s3_part_bytes=5 * 1024 * 1024, s3_retries=0, s3_connect_retries=0):
            remote = object_tier(s3_bucket, s3_options, prefix=prefix)
            try:
                remote.connect()
                for client in remote.lanes:
                    for operation in refused:
                        client._s3.meta.events.register(f"before-send.s3.{operation}", refuse)
                with pytest.raises((CkptdError, OSError)):
                    remote.write_bytes(_KEY, os.urandom(3 * 5 * 1024 * 1024))
            finally:
                remote.close()
        uploads = [u for u in boto.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
                   if u["Key"].startswith(f"{prefix}/")]
        records = boto.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/{OWNERS_PREFIX}/").get("Contents", [])
        assert len(uploads) == (1 if record_kept else 0), (refused, uploads)
        assert len(records) == (1 if record_kept else 0), (refused, records)
        if record_kept:
            body = boto.get_object(Bucket=s3_bucket, Key=records[0]["Key"])["Body"].read()
            owner = UploadOwner.from_json_bytes(body)
            assert owner is not None and owner.pid == os.getpid() and owner.started == process_start(os.getpid())
            gone = UploadOwner(owner.key, owner.host, owner.pid, owner.refreshed, owner.lease_s, "another-boot:1")
            boto.put_object(Bucket=s3_bucket, Key=records[0]["Key"], Body=gone.to_json_bytes())
            collector = object_tier(s3_bucket, s3_options, prefix=prefix)
            try:
                assert collector.abort_incomplete_uploads(3600.0) == 1, "its owner is gone: aborted at once"
            finally:
                collector.close()
