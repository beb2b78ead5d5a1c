"""S3 faults survived: a fault-injecting proxy on loopback between s3fs and moto's server returns 500,
503 SlowDown, connection resets, stalls past the read timeout and truncated bodies on a chosen fraction of
requests. Bytes are compared after every run."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import StorageError
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.stepio.step_reader import verify_step
from ckptd.promotion import collect_garbage, promote_step
from ckptd.testing.fault_proxy import FAULT_KINDS, FaultProxy
from test_promotion_support import object_tier, same_bytes, save_local, zero_like

pytestmark = pytest.mark.s3

#: Client settings for fault runs: stalls (1.5 s) outlast the read timeout (1 s).
FAULT_SETTINGS = {"s3_read_timeout_s": 1.0, "s3_connect_timeout_s": 1.0, "s3_retries": 8,
                  "chunk_bytes": 4 * 1024 * 1024, "s3_part_bytes": 5 * 1024 * 1024}


def _promote_with_faults(tmp_path, s3_server, s3_bucket, megabytes: int, seed: int) -> None:
    state = {"weights": torch.randn(megabytes * 256 * 1024, generator=torch.Generator().manual_seed(seed)),
             "bias": torch.arange(1000, dtype=torch.float64)}
    with override(**FAULT_SETTINGS):
        local = save_local(tmp_path / "local", {1: state}, chunk_bytes=FAULT_SETTINGS["chunk_bytes"])
        with FaultProxy(s3_server.endpoint_url, fraction=0.2, stall_s=1.5, seed=seed) as proxy:
            remote = object_tier(s3_bucket, proxy.storage_options(s3_server.storage_options))
            report = promote_step(local, remote, 1)
            assert report.chunks_uploaded == report.chunks
            assert list(verify_step(remote, 1)) == [], "verification through the faulty proxy"
            restored = zero_like(state)
            with ckptd.CheckpointManager(tmp_path / "empty", remote=remote.url, capture_rng=False,
                                         storage_options=proxy.storage_options(s3_server.storage_options)) as mgr:
                assert mgr.restore(restored) == 1
            assert same_bytes(restored, state)
            assert set(proxy.counts) >= set(FAULT_KINDS), f"every fault kind was injected: {dict(proxy.counts)}"
    direct = object_tier(s3_bucket, s3_server.storage_options)
    assert direct.committed_steps() == [1]
    assert list(verify_step(direct, 1)) == []


@pytest.mark.slow
def test_200_mb_promotion_survives_20_percent_faults(tmp_path, s3_server, s3_bucket):
    _promote_with_faults(tmp_path, s3_server, s3_bucket, megabytes=200, seed=12)


def test_every_request_failing_gives_a_clear_error_and_commits_nothing(tmp_path, s3_server, s3_bucket):
    state = {"weights": torch.randn(3 * 1024 * 1024)}
    with override(**dict(FAULT_SETTINGS, s3_retries=2, s3_read_timeout_s=0.5)):
        local = save_local(tmp_path / "local", {4: state}, chunk_bytes=FAULT_SETTINGS["chunk_bytes"])
        with FaultProxy(s3_server.endpoint_url, fraction=1.0, stall_s=0.7, seed=5) as proxy:
            remote = object_tier(s3_bucket, proxy.storage_options(s3_server.storage_options))
            with pytest.raises(StorageError) as caught:
                promote_step(local, remote, 4)
            assert proxy.faults_injected == proxy.counts["requests"] > 0
    # the first request (the step owner lease's record) already fails: a typed error naming the tier and
    # the setting that sets the patience; the wording of the retry path is not the contract
    message = str(caught.value)
    assert "CKPTD_S3_RETRIES" in message and "s3://" in str(caught.value.tier), (message, caught.value.tier)
    assert local.committed_steps() == [4] and list(verify_step(local, 4)) == [], "the local copy stays"
    direct = object_tier(s3_bucket, s3_server.storage_options)
    assert direct.committed_steps() == []
    assert not direct.exists(step_file(4, MANIFEST_NAME))
    collect_garbage(direct, abandoned_after_s=0)
    assert direct.incomplete_uploads() == [], "no multipart upload left behind"
