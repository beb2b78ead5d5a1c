"""What the daemon's look for abandoned uploads costs while other writers upload into its prefix.

``Upkeep.abort_abandoned_uploads`` looks again at every maintenance pass (every few seconds) only while an open
upload shares its key with another one: a dead writer's upload of a key a live writer is uploading anew is
spared while that runs (row 29). Before, it looked again at every pass while any upload at all was open, so on
a prefix that other nodes' daemons and trainers promote into (some upload nearly always open) every daemon
paid three listings and two reads per owner record every pass for as long as the job ran. The requests are
counted by a proxy in front of moto's real server."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from ckptd.daemon.upkeep import Upkeep
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.tiers.upload_owners import UploadOwner
from test_daemon_abandoned_uploads import _dead_pid, _open_upload, _open_uploads
from test_promotion_support import object_tier, s3_client

pytestmark = pytest.mark.s3


def _upkeep() -> Upkeep:
    return Upkeep(None, None, lambda *error: None)  # type: ignore[arg-type] - uploads need neither


def test_live_uploads_alone_are_looked_at_once_and_a_shared_key_at_every_pass(s3_server, s3_bucket) -> None:
    client = s3_client(s3_server)
    live = _open_upload(client, s3_bucket, "chunks/aa/live.raw", UploadOwner.mine("chunks/aa/live.raw"))
    with FaultProxy(s3_server.endpoint_url) as proxy:
        runtime = SimpleNamespace(name="run1", remote=object_tier(s3_bucket, proxy.storage_options(
            s3_server.storage_options), prefix="run1"))
        upkeep = _upkeep()
        assert upkeep.abort_abandoned_uploads(runtime) == 0  # type: ignore[arg-type]
        first = proxy.counts["requests"]
        assert first > 0
        for _ in range(3):
            assert upkeep.abort_abandoned_uploads(runtime) == 0  # type: ignore[arg-type]
        assert proxy.counts["requests"] == first, "a pass with only live uploads open asked the store again"
        assert live in _open_uploads(client, s3_bucket)

        # a dead writer's upload of a key a live writer uploads again: looked at every pass, aborted once alone
        key = "chunks/bb/again.raw"
        orphan = _open_upload(client, s3_bucket, key, replace(UploadOwner.mine(key), pid=_dead_pid()))
        again = _open_upload(client, s3_bucket, key, UploadOwner.mine(key))
        watching = _upkeep()
        assert watching.abort_abandoned_uploads(runtime) == 0  # type: ignore[arg-type]
        before = proxy.counts["requests"]
        assert watching.abort_abandoned_uploads(runtime) == 0  # type: ignore[arg-type]
        assert proxy.counts["requests"] > before, "a key with two open uploads was not looked at again"
        assert {orphan, again} <= set(_open_uploads(client, s3_bucket))
        client.abort_multipart_upload(Bucket=s3_bucket, Key=f"run1/{key}", UploadId=again)
        records = client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/uploads/").get("Contents", [])
        for item in records:
            record = UploadOwner.from_json_bytes(client.get_object(Bucket=s3_bucket, Key=item["Key"])["Body"].read())
            if record is not None and record.key == key and record.pid == os.getpid():
                client.delete_object(Bucket=s3_bucket, Key=item["Key"])  # the live writer is done
        assert watching.abort_abandoned_uploads(runtime) == 1  # type: ignore[arg-type]
        assert orphan not in _open_uploads(client, s3_bucket) and live in _open_uploads(client, s3_bucket)
