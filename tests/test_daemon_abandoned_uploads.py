"""A daemon that starts after a crash aborts the multipart uploads the dead writer left on its object tier.

A daemon SIGKILLed in the middle of a multipart upload leaves the upload open on S3 (its parts are stored and
billed, never visible) with the owner record of its dead process (:mod:`ckptd.tiers.upload_owners`). The next
daemon on that root aborts it, and deletes the dead record, at its first maintenance pass; an upload whose
owner still runs is left alone. The uploads here are real ones on moto's server, made with boto3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.daemon_process import DaemonProcess, write_config
from ckptd.tiers.upload_owners import UploadOwner, new_record_path
from test_promotion_support import s3_client

pytestmark = pytest.mark.s3


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _open_upload(client: Any, bucket: str, key: str, owner: UploadOwner) -> str:
    """Start a multipart upload of ``run1/<key>`` with one part and its owner record; returns its id."""
    record = f"run1/{new_record_path(key)}"
    client.put_object(Bucket=bucket, Key=record, Body=owner.to_json_bytes())
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"run1/{key}")["UploadId"]
    client.upload_part(Bucket=bucket, Key=f"run1/{key}", UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    return upload


def _open_uploads(client: Any, bucket: str) -> dict[str, str]:
    return {item["UploadId"]: item["Key"] for item in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}


def test_the_uploads_of_a_dead_writer_are_aborted_and_a_live_ones_kept(tmp_path: Path, s3_server, s3_bucket,
                                                                        s3_options) -> None:
    client = s3_client(s3_server)
    dead = replace(UploadOwner.mine("chunks/aa/dead.raw"), pid=_dead_pid())
    alive = UploadOwner.mine("chunks/bb/alive.raw")  # this test process: it runs
    orphan = _open_upload(client, s3_bucket, "chunks/aa/dead.raw", dead)
    kept = _open_upload(client, s3_bucket, "chunks/bb/alive.raw", alive)
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1", "storage_options": s3_options}],
                          state_dir=str(state), node_id="node-a", listen="127.0.0.1:0", poll_interval_s=0.1,
                          scrub_interval_s=0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: orphan not in _open_uploads(client, s3_bucket), 15,
                        "the dead writer's upload to be aborted")
        time.sleep(0.5)  # a later pass must not take the live one either
        assert daemon.terminate() == 0
    assert _open_uploads(client, s3_bucket) == {kept: "run1/chunks/bb/alive.raw"}
    records = [item["Key"] for item in client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/uploads/")
               .get("Contents", [])]
    assert len(records) == 1 and f"-{alive.pid}-" in records[0], records
    assert "aborted an abandoned multipart upload of chunks/aa/dead.raw" in daemon.log()


def test_a_dead_writers_upload_of_a_key_someone_is_uploading_again_is_aborted_once_that_ends(
        tmp_path: Path, s3_server, s3_bucket, s3_options) -> None:
    # a restarted daemon uploads the same content-addressed chunk again: while its upload runs, the key has a
    # live owner and the dead writer's upload of that key is left alone; once it is done, it goes
    client = s3_client(s3_server)
    key = "chunks/cc/same.raw"
    orphan = _open_upload(client, s3_bucket, key, replace(UploadOwner.mine(key), pid=_dead_pid()))
    again = _open_upload(client, s3_bucket, key, UploadOwner.mine(key))
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1", "storage_options": s3_options}],
                          state_dir=str(state), node_id="node-a", listen="127.0.0.1:0", poll_interval_s=0.1,
                          scrub_interval_s=0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        time.sleep(6.0)  # maintenance passes (one a second) while the key has a live owner
        assert orphan in _open_uploads(client, s3_bucket), "an upload of a key with a live owner was aborted"
        parts = client.list_parts(Bucket=s3_bucket, Key=f"run1/{key}", UploadId=again)["Parts"]
        client.complete_multipart_upload(Bucket=s3_bucket, Key=f"run1/{key}", UploadId=again, MultipartUpload={
            "Parts": [{"PartNumber": part["PartNumber"], "ETag": part["ETag"]} for part in parts]})
        for item in client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/uploads/").get("Contents", []):
            if f"-{os.getpid()}-" in item["Key"]:
                client.delete_object(Bucket=s3_bucket, Key=item["Key"])  # the live writer is done
        daemon.wait_for(lambda: not _open_uploads(client, s3_bucket), 15, "the dead writer's upload to be aborted")
        assert daemon.terminate() == 0


def test_a_dead_writers_record_outlives_a_pass_that_spared_its_upload_for_a_live_owner(
        s3_server, s3_bucket, s3_options) -> None:
    # the pass between the live writer's completed upload and the deletion of its record (the race the
    # daemon test above ran into under load): the dead writer's upload is spared, its record must stay, so
    # that the next pass still knows whose the upload is and aborts it at once, not after gc_abandoned_s
    from test_promotion_support import object_tier

    client = s3_client(s3_server)
    key = "chunks/dd/again.raw"
    orphan = _open_upload(client, s3_bucket, key, replace(UploadOwner.mine(key), pid=_dead_pid()))
    again = _open_upload(client, s3_bucket, key, UploadOwner.mine(key))
    remote = object_tier(s3_bucket, s3_options, prefix="run1")
    try:
        remote.connect()
        assert remote.abort_incomplete_uploads(3600.0) == 0, "the key has a live owner: nothing aborted"
        assert remote.uploads_awaiting_owners() == [key]
        parts = client.list_parts(Bucket=s3_bucket, Key=f"run1/{key}", UploadId=again)["Parts"]
        client.complete_multipart_upload(Bucket=s3_bucket, Key=f"run1/{key}", UploadId=again, MultipartUpload={
            "Parts": [{"PartNumber": part["PartNumber"], "ETag": part["ETag"]} for part in parts]})
        assert remote.abort_incomplete_uploads(3600.0) == 0, "the live writer's record is still there"
        assert remote.uploads_awaiting_owners() == [key], "the dead writer's upload still waits on that key"
        for item in client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/uploads/").get("Contents", []):
            if f"-{os.getpid()}-" in item["Key"]:
                client.delete_object(Bucket=s3_bucket, Key=item["Key"])
        assert remote.abort_incomplete_uploads(3600.0) == 1, "its owner is gone: aborted at once"
        assert orphan not in _open_uploads(client, s3_bucket) and remote.uploads_awaiting_owners() == []
        left = client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/uploads/").get("Contents", [])
        assert left == [], "the dead writer's record goes with its upload"
    finally:
        remote.close()
