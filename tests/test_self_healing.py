"""Self-healing dedup: objects found bad on the object tier are recorded, never reused, uploaded again
by the next promotion and mended in older steps by ``ckptd verify --repair``."""

from __future__ import annotations

import os
from collections import Counter

import boto3
import pytest
import torch

from ckptd.config import override
from ckptd.errors import UnsafePathError
from ckptd.promotion import dedup, promote_step
from ckptd.promotion.contents import read_step_contents, read_stored_chunk
from ckptd.promotion.dedup import chunks_to_upload, forget_verified, mark_uploaded
from ckptd.tiers.chunk_health import bad_chunk_paths, clear_bad_chunk, report_bad_chunk
from ckptd.tiers.s3_transfers import crc32_checksum
from test_promotion_support import model_state, object_tier, save_local

pytestmark = pytest.mark.s3


def test_bad_records_are_kept_outside_steps_and_chunks(s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    remote.write_bytes("chunks/ab/abcd.raw", b"x" * 10)
    report_bad_chunk(remote, "chunks/ab/abcd.raw", step=3, reason="digest mismatch")
    report_bad_chunk(remote, "step-000000000003/rank-00000.pack", step=3, reason="digest mismatch")
    assert bad_chunk_paths(remote) == {"chunks/ab/abcd.raw", "step-000000000003/rank-00000.pack"}
    assert remote.list_step_numbers() == [], "a record is not a step directory"
    assert [obj.path for obj in remote.list_objects("chunks")] == ["chunks/ab/abcd.raw"]
    clear_bad_chunk(remote, "chunks/ab/abcd.raw")
    clear_bad_chunk(remote, "chunks/ab/never-recorded.raw")
    assert bad_chunk_paths(remote) == {"step-000000000003/rank-00000.pack"}
    with pytest.raises(UnsafePathError, match="not a file under the tier root"):
        report_bad_chunk(remote, "../elsewhere/x", step=None, reason="scrub")


# --- dedup: a stored chunk is reused only when the store's checksum matches the intact local copy --------

_BIG_CHUNK = 2 * 1024 * 1024  # above the pack threshold: content-addressed, shared by the steps


def _states() -> dict[int, dict[str, torch.Tensor]]:
    return {step: model_state(step, frozen_elements=1024 * 1024) for step in (1, 2)}


def _frozen_keys(contents) -> list[str]:
    return [chunk.object_key for chunk in contents.shares[0].index.tensors["frozen"].chunks]


def _count_requests(tier) -> Counter:
    """Requests every client of ``tier`` sends from now on, by operation."""
    sent: Counter = Counter()
    for client in [*tier.lanes, tier.fs]:
        tier._lanes.run(client, client.set_session)
        client._s3.meta.events.register(
            "before-send.s3", lambda request, **_: sent.update([request.url.split("?")[0].rsplit("/", 1)[-1]
                                                                if request.method == "GET" else request.method]))
    return sent


def _boto(server, *, checksums: bool = True):
    """A plain boto3 client; ``checksums=False`` sends no checksum, so the store keeps none."""
    from botocore.config import Config

    config = Config(request_checksum_calculation="when_supported" if checksums else "when_required")
    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1", config=config)


def _tamper_same_size(server, bucket: str, key: str, *, with_checksum: bool = True) -> bytes:
    """Flip one byte of a chunk object behind ckptd's back (plain boto3); returns the tampered body."""
    client = _boto(server, checksums=with_checksum)
    body = bytearray(client.get_object(Bucket=bucket, Key=f"run/chunks/{key}")["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=f"run/chunks/{key}", Body=bytes(body))
    return bytes(body)


@pytest.mark.parametrize("with_checksum", [True, False], ids=["store-checksum", "no-store-checksum"])
def test_dedup_catches_a_same_size_tampered_chunk(tmp_path, s3_server, s3_bucket, s3_options, with_checksum):
    with override(chunk_bytes=_BIG_CHUNK):
        local = save_local(tmp_path / "local", _states(), chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(local, remote, 1)
        forget_verified()
        contents = read_step_contents(local, 2)
        needed = contents.unique_chunks()
        first = chunks_to_upload(remote, needed, local)
        assert {chunk.object_key for _, chunk in first} == set(needed) - set(_frozen_keys(contents)), \
            "only step 2's own chunks are missing"
        assert dedup.last_check.checked_by_checksum == 2 and dedup.last_check.mismatched == 0

        victim = _frozen_keys(contents)[0]
        _tamper_same_size(s3_server, s3_bucket, victim, with_checksum=with_checksum)
        sent = _count_requests(remote)
        second = chunks_to_upload(remote, needed, local)
        assert victim in {chunk.object_key for _, chunk in second}, "the tampered chunk is uploaded again"
        assert _frozen_keys(contents)[1] not in {chunk.object_key for _, chunk in second}
        assert bad_chunk_paths(remote) == {f"chunks/{victim}"}
        if with_checksum:
            assert dedup.last_check.checked_by_checksum == 1, "only the replaced object (new ETag) is checked"
            assert dedup.last_check.remembered == 1, "the untouched frozen chunk is remembered"
            chunk_reads = [name for name in sent if name.endswith((".raw", ".zst", ".bpz"))]
            assert not chunk_reads and sent["HEAD"] == 1, f"a HEAD, not a download: {dict(sent)}"
        else:
            assert dedup.last_check.checked_by_reading == 1, "no checksum kept: read back once and compared"

        for share, chunk in second:  # what the promoter does with the answer
            remote.write_bytes(remote.chunk_path(chunk.object_key), read_stored_chunk(local, share, chunk))
        mark_uploaded(remote, [chunk.object_key for _, chunk in second])
        assert bad_chunk_paths(remote) == set(), "the record is cleared once an intact copy is stored"
        assert chunks_to_upload(remote, needed, local) == []
        stored = remote.read_bytes(remote.chunk_path(victim))
        share, chunk = needed[victim]
        assert stored == read_stored_chunk(local, share, chunk), "the object tier holds the intact bytes again"
    finally:
        remote.close()


def test_uploads_ask_the_store_for_a_crc32_of_the_whole_object(s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    try:
        small, large = os.urandom(1000), os.urandom(2 * 5 * 1024 * 1024 + 17)
        with override(s3_part_bytes=5 * 1024 * 1024):
            remote.write_bytes("chunks/aa/small.raw", small)
            remote.write_bytes("chunks/aa/large.raw", large)
        assert remote.stored_checksum("chunks/aa/small.raw")[2] == crc32_checksum(small)
        assert remote.stored_checksum("chunks/aa/large.raw")[2] == crc32_checksum(large), \
            "a multipart upload keeps a full-object CRC32, not a per-part one"
    finally:
        remote.close()
