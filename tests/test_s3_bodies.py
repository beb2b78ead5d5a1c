"""How the object tier's data clients send and receive bodies (against moto over HTTP): upload bodies go
to aiohttp whole, not through botocore's BytesIO wrapper, and GETs skip botocore's CRC32 check (ckptd
verifies chunks itself) while the metadata client's HEAD still returns the stored CRC32. These are the
lanes' clients (``s3_blocking_data`` off); the last test sends single PUTs and GETs through the blocking
client (the default) past injected faults."""

from __future__ import annotations

import base64
import os
import warnings
import zlib
from collections.abc import Iterator

import pytest

from ckptd.config import override
from ckptd.tiers.s3_transfers import _whole_body_class
from test_promotion_support import object_tier

_PART = 5 * 1024 * 1024


@pytest.fixture(autouse=True)
def _on_the_lanes(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.name.startswith("test_blocking_"):
        yield
        return
    with override(s3_blocking_data=False):
        yield


def _crc32(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode("ascii")


def _count_bodies(tier) -> list[str]:
    """The type name of every PutObject and UploadPart body the data clients hand to aiohttp from now on."""
    seen: list[str] = []

    def record(request, event_name, **_):
        if event_name.endswith((".PutObject", ".UploadPart")):
            seen.append(type(request.body).__name__)

    for client in tier.lanes:
        tier._lanes.run(client, client.set_session)
        client._s3.meta.events.register_last("before-send.s3", record)
    return seen


def test_upload_bodies_go_whole_and_arrive_intact(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)
    try:
        bodies = _count_bodies(tier)
        single, parts = os.urandom(3 * 1024 * 1024), os.urandom(3 * _PART + 7)
        with override(s3_part_bytes=_PART, s3_concurrency=2), warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)  # aiohttp's warning for large raw bytes
            tier.write_bytes("chunks/aa/single.raw", single)
            tier.write_bytes("chunks/aa/parts.raw", bytearray(parts))
        assert len(bodies) >= 1 + 4, bodies  # the single PUT and four parts (and the upload's owner record)
        assert set(bodies) == {_whole_body_class().__name__}, bodies
        assert tier.read_bytes("chunks/aa/single.raw") == single
        assert tier.read_bytes("chunks/aa/parts.raw") == parts
        assert tier.stored_checksum("chunks/aa/single.raw")[2] == _crc32(single)
        assert tier.stored_checksum("chunks/aa/parts.raw")[2] == _crc32(parts)
    finally:
        tier.close()


def test_gets_skip_botocore_crc_but_the_dedup_head_keeps_it(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)
    try:
        tier.connect()
        assert {client._s3._client_config.response_checksum_validation for client in tier.lanes} \
            == {"when_required"}
        assert tier.fs._s3._client_config.response_checksum_validation == "when_supported"
        data = os.urandom(1024 * 1024)
        tier.write_bytes("chunks/bb/one.raw", data)
        assert tier.read_bytes("chunks/bb/one.raw") == data
        assert tier.stored_checksum("chunks/bb/one.raw") == (len(data), tier.stored_checksum("chunks/bb/one.raw")[1],
                                                            _crc32(data))
    finally:
        tier.close()


def test_a_retried_upload_resends_its_whole_body(s3_server, s3_bucket, s3_options):
    """Requests reset after the store took them, or refused before, are sent again by botocore with a fresh
    signature: each retry must carry the whole body once (the payload's rewind is a no-op), not an empty,
    partial or doubled one. The stored bytes and the store's CRC32 prove it."""
    from ckptd.testing.fault_proxy import FaultProxy

    single, parts = os.urandom(2 * 1024 * 1024 + 3), os.urandom(3 * _PART + 11)
    with override(s3_part_bytes=_PART, s3_concurrency=2, s3_retries=12, s3_backoff_base_s=0.01,
                  s3_backoff_max_s=0.05), \
            FaultProxy(s3_server.endpoint_url, fraction=0.3, kinds=("500", "reset"), seed=7) as proxy:
        tier = object_tier(s3_bucket, proxy.storage_options(s3_options))
        try:
            bodies = _count_bodies(tier)
            for attempt in range(3):
                tier.write_bytes(f"chunks/cc/single{attempt}.raw", single)
                tier.write_bytes(f"chunks/cc/parts{attempt}.raw", bytearray(parts))
            assert proxy.faults_injected > 0, "the proxy injected faults, so some bodies were sent again"
            assert set(bodies) == {_whole_body_class().__name__}, bodies
        finally:
            tier.close()
    tier = object_tier(s3_bucket, s3_options)
    try:
        for attempt in range(3):
            assert tier.read_bytes(f"chunks/cc/single{attempt}.raw") == single
            assert tier.read_bytes(f"chunks/cc/parts{attempt}.raw") == parts
            assert tier.stored_checksum(f"chunks/cc/parts{attempt}.raw")[2] == _crc32(parts)
    finally:
        tier.close()


def test_a_botocore_without_the_body_wrapper_handler_still_uploads(s3_bucket, s3_options, monkeypatch, caplog):
    """A botocore that moved or renamed convert_body_to_file_like_object must not stop every upload: the
    data clients then keep botocore's own way of sending bodies, and say so."""
    import botocore.handlers

    monkeypatch.delattr(botocore.handlers, "convert_body_to_file_like_object")
    tier = object_tier(s3_bucket, s3_options)
    try:
        bodies = _count_bodies(tier)
        data = os.urandom(1024 * 1024 + 5)
        tier.write_bytes("chunks/dd/one.raw", data)
        assert bodies and _whole_body_class().__name__ not in bodies, bodies
        assert tier.read_bytes("chunks/dd/one.raw") == data
        assert "botocore's own wrapper" in caplog.text
    finally:
        tier.close()


def test_blocking_puts_and_gets_past_injected_faults_carry_whole_bodies(s3_server, s3_bucket, s3_options):
    """The default path: single PUTs and GETs of the blocking botocore client, through a proxy that answers
    500 or resets a third of the requests; every retry sends and reads the whole body, and the stored bytes
    and the store's CRC32 match."""
    from ckptd.testing.fault_proxy import FaultProxy

    bodies = [os.urandom(2 * 1024 * 1024 + index) for index in range(6)]
    with override(s3_retries=12, s3_backoff_base_s=0.01, s3_backoff_max_s=0.05), \
            FaultProxy(s3_server.endpoint_url, fraction=0.3, kinds=("500", "reset"), seed=11) as proxy:
        tier = object_tier(s3_bucket, proxy.storage_options(s3_options))
        try:
            assert tier._blocking is not None, "the blocking client is the default"
            for index, body in enumerate(bodies):
                tier.write_bytes(f"chunks/ee/one{index}.raw", body)
            for index, body in enumerate(bodies):
                assert tier.read_bytes(f"chunks/ee/one{index}.raw") == body
                assert tier.read_bytes(f"chunks/ee/one{index}.raw", 1000, 4096) == body[1000:5096]
            assert proxy.faults_injected > 0, "the proxy injected faults, so some requests were sent again"
        finally:
            tier.close()
    tier = object_tier(s3_bucket, s3_options)
    try:
        for index, body in enumerate(bodies):
            assert tier.stored_checksum(f"chunks/ee/one{index}.raw")[2] == _crc32(body)
    finally:
        tier.close()
