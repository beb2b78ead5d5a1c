"""Whole-object reads of the object tier straight into memory (``ObjectTier.read_whole_into``, against
moto over HTTP): the blocking client's bodies are read by http.client into the caller's buffer and
their connections go back to the pool; other bodies are read piece by piece; injected faults are
retried and the bytes arrive whole; a restore from S3 reads its uncompressed chunks this way instead
of fetching them ahead into new buffers."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import IntegrityError
from ckptd.promotion import prefetch_step, promote_step
from ckptd.tiers import s3_blocking
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier

_MIB = 1024 * 1024


def _pieces_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every buffer read piece by piece from now on (the real reader still does the work)."""
    sizes: list[int] = []
    real = s3_blocking._read_pieces_into

    def spy(body, view):
        sizes.append(len(view))
        return real(body, view)

    monkeypatch.setattr(s3_blocking, "_read_pieces_into", spy)
    return sizes


def test_blocking_whole_reads_go_straight_into_memory_and_give_their_connection_back(
        s3_bucket, s3_options, monkeypatch, caplog):
    """A body read into place returns its connection to the pool, which the next GET takes: urllib3 logs a
    new connection only when its pool has none. (moto's server closes every connection after its answer,
    so urllib3 opens the pooled one again, "Resetting dropped connection"; S3 keeps them open.)"""
    bodies = [os.urandom(2 * _MIB + index) for index in range(5)]
    tier = object_tier(s3_bucket, s3_options)
    try:
        assert tier._blocking is not None, "the blocking client is the default"
        for index, body in enumerate(bodies):
            tier.write_bytes(f"chunks/aa/whole{index}.raw", body)
        tier.read_whole_into("chunks/aa/whole0.raw", memoryview(bytearray(len(bodies[0]))))  # connects
        pieces = _pieces_read(monkeypatch)
        caplog.set_level(logging.DEBUG, logger="urllib3.connectionpool")
        caplog.clear()
        for index, body in enumerate(bodies):
            buffer = bytearray(len(body))
            tier.read_whole_into(f"chunks/aa/whole{index}.raw", memoryview(buffer))
            assert buffer == body
        opened = [record.getMessage() for record in caplog.records if "Starting new" in record.getMessage()]
        assert not opened, f"every GET after the first takes the pooled connection: {opened}"
        assert not pieces, "S3's bodies are read by http.client into the buffer, not piece by piece"
    finally:
        tier.close()


class _OtherBody:
    """A body that only has ``read`` (another HTTP stack's): wraps the real botocore body."""

    def __init__(self, body) -> None:
        self._body = body

    def read(self, amount: int | None = None) -> bytes:
        return self._body.read(amount)


def test_a_body_of_another_kind_is_read_piece_by_piece(s3_bucket, s3_options, monkeypatch):
    body = os.urandom(3 * _MIB + 5)
    tier = object_tier(s3_bucket, s3_options)
    try:
        tier.write_bytes("chunks/bb/other.raw", body)
        pieces = _pieces_read(monkeypatch)
        client = tier._blocking.client
        for size in (len(body), _MIB + 1):  # the whole body; a buffer that ends first
            response = client.get_object(Bucket=s3_bucket, Key=tier.key("chunks/bb/other.raw"))
            buffer = bytearray(size)
            try:
                assert s3_blocking.read_body_into(_OtherBody(response["Body"]), memoryview(buffer)) == size
            finally:
                response["Body"].close()
            assert buffer == body[:size]
        assert pieces == [len(body), _MIB + 1]
    finally:
        tier.close()


def test_whole_reads_in_parts_arrive_whole_past_injected_faults(s3_server, s3_bucket, s3_options):
    """Objects of one and of three parts, through a proxy that answers 500, resets or cuts bodies short
    for a third of the requests: every read fills its buffer with exactly the stored bytes."""
    from ckptd.testing.fault_proxy import FaultProxy

    bodies = {"chunks/cc/one.raw": os.urandom(2 * _MIB + 3), "chunks/cc/three.raw": os.urandom(11 * _MIB + 17)}
    tier = object_tier(s3_bucket, s3_options)
    try:
        for path, body in bodies.items():
            tier.write_bytes(path, body)
    finally:
        tier.close()
    with override(s3_retries=12, s3_backoff_base_s=0.01, s3_backoff_max_s=0.05, s3_part_bytes=5 * _MIB,
                  s3_concurrency=3), \
            FaultProxy(s3_server.endpoint_url, fraction=0.3, kinds=("500", "reset", "truncate"), seed=5) as proxy:
        tier = object_tier(s3_bucket, proxy.storage_options(s3_options))
        try:
            for _ in range(3):
                for path, body in bodies.items():
                    buffer = bytearray(len(body))
                    tier.read_whole_into(path, memoryview(buffer))
                    assert buffer == body, path
            with pytest.raises(IntegrityError, match="wrong stored length"):
                tier.read_whole_into("chunks/cc/one.raw", memoryview(bytearray(len(bodies["chunks/cc/one.raw"]) - 1)))
            assert proxy.faults_injected > 0
        finally:
            tier.close()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_restore_from_s3_reads_its_uncompressed_chunks_into_place(tmp_path: Path, s3_bucket, s3_options, codec):
    """Only compressed chunks are fetched ahead of the reader; raw ones go straight into the tensors,
    and either way a fresh manager on an empty local tier restores every byte."""
    state = {f"layer{index}": torch.randn(600_000, generator=torch.Generator().manual_seed(index))
             for index in range(3)}
    with ckptd.CheckpointManager(tmp_path / "saved", codec=codec, capture_rng=False) as manager:
        manager.save(1, state)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(LocalTier(tmp_path / "saved"), remote, 1)
        hinted = prefetch_step(remote, 1, 0)
        assert (hinted == 0) == (codec == "raw"), f"{hinted} chunks fetched ahead with codec {codec}"
    finally:
        remote.close()
    target = {name: torch.zeros_like(value) for name, value in state.items()}
    with ckptd.CheckpointManager(tmp_path / "empty", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        assert manager.restore(target) == 1
        assert manager.last_restore.chunks_by_tier.get(remote.label), manager.last_restore.chunks_by_tier
    for name, value in state.items():
        assert torch.equal(target[name], value), name
