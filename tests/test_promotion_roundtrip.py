"""Promotion round trips against moto's S3 server on loopback: remote restore equals the saved bytes,
an empty local tier restores from S3 (and can be re-populated), promotion is idempotent."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import CommitError, IntegrityError
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.stepio.step_reader import verify_step
from ckptd.promotion import Promoter, promote_step
from ckptd.testing import tamper
from test_promotion_support import (SMALL_CHUNK, flip_bit, model_state, object_tier, s3_client, same_bytes,
                                    save_local, zero_like)

pytestmark = pytest.mark.s3


def test_promoted_step_verifies_and_restores_the_saved_bytes(tmp_path, s3_bucket, s3_options):
    states = {1: model_state(1), 2: model_state(2)}
    local = save_local(tmp_path / "local", states)
    remote = object_tier(s3_bucket, s3_options)
    for step in (1, 2):
        report = promote_step(local, remote, step)
        assert not report.already_committed and report.chunks > 1
    assert remote.committed_steps() == [1, 2]
    assert [list(verify_step(remote, step)) for step in (1, 2)] == [[], []]
    assert not any(name.endswith(".data") for name in remote.list_files(2)), "object tier keeps no data files"
    for step in (1, 2):
        restored = zero_like(states[step])
        with ckptd.CheckpointManager(tmp_path / f"empty-{step}", remote=remote.url, storage_options=s3_options,
                                     capture_rng=False) as manager:
            assert manager.restore(restored, step=step) == step
            assert manager.last_restore.tier == remote.label
        assert same_bytes(restored, states[step])


def test_manager_promotes_in_background_and_an_empty_node_restores_from_s3(tmp_path, s3_bucket, s3_options):
    url = f"s3://{s3_bucket}/job"
    policy = ckptd.Policy(every_steps=1, remote_every_steps=2, keep_local=1, keep_remote=2)
    state = model_state(0)
    with override(chunk_bytes=SMALL_CHUNK):
        with ckptd.CheckpointManager(tmp_path / "node-a", remote=url, storage_options=s3_options, policy=policy,
                                     capture_rng=False) as manager:
            assert [tier.kind for tier in manager.tiers] == ["local", "object"]
            for step in range(1, 7):
                state["trained"].add_(1.0)
                manager.save(step, state)
                manager.wait_uploads()  # uploaded before the next save: a newer step supersedes queued ones
            assert manager.local.committed_steps() == [6]
            assert manager.remote.committed_steps() == [4, 6]
    restored = zero_like(state)
    with ckptd.CheckpointManager(tmp_path / "node-b", remote=url, storage_options=s3_options,
                                 capture_rng=False, repopulate_local=True) as manager:
        assert manager.restore(restored) == 6
        assert manager.last_restore.tier == manager.remote.label
        assert manager.local.committed_steps() == [6], "the local tier was re-populated"
        assert list(verify_step(manager.local, 6)) == []
    original, pulled = tmp_path / "node-a" / step_dir(6), tmp_path / "node-b" / step_dir(6)
    names = sorted(path.name for path in original.iterdir())
    assert len([name for name in names if name.endswith(".data")]) > 1, "several data files per rank"
    assert names == sorted(path.name for path in pulled.iterdir())
    assert all((original / name).read_bytes() == (pulled / name).read_bytes() for name in names), \
        "re-populated files are byte for byte the promoted ones"
    assert same_bytes(restored, state)
    again = zero_like(state)
    with ckptd.CheckpointManager(tmp_path / "node-b", capture_rng=False) as manager:
        assert manager.restore(again) == 6 and manager.last_restore.tier == manager.local.label
    assert same_bytes(again, state)


def test_promotion_is_idempotent_and_manifest_written_once(tmp_path, s3_server, s3_bucket, s3_options):
    client = s3_client(s3_server)
    client.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    local = save_local(tmp_path / "local", {3: model_state(3)})
    remote = object_tier(s3_bucket, s3_options)
    first = promote_step(local, remote, 3)
    second = promote_step(local, remote, 3)
    assert second.already_committed and second.bytes_uploaded == 0
    assert first.bytes_uploaded > first.chunk_bytes > 0
    versions = client.list_object_versions(Bucket=s3_bucket, Prefix=f"run/{step_dir(3)}/{MANIFEST_NAME}")
    assert len(versions.get("Versions", [])) == 1


def test_a_different_step_with_the_same_number_is_refused(tmp_path, s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    promote_step(save_local(tmp_path / "a", {5: model_state(1)}), remote, 5)
    with pytest.raises(CommitError, match="different step"):
        promote_step(save_local(tmp_path / "b", {5: model_state(2)}), remote, 5)


def test_a_corrupt_local_chunk_is_never_promoted(tmp_path, s3_bucket, s3_options):
    local = save_local(tmp_path / "local", {1: model_state(1)})
    data_file, offset, _ = tamper.chunk_location(local.root, 1, "frozen", 1)
    flip_bit(data_file, offset + 7)
    remote = object_tier(s3_bucket, s3_options)
    with pytest.raises(IntegrityError) as caught:
        promote_step(local, remote, 1)
    message = str(caught.value)
    assert data_file.name in message and "step 1" in message and "local" in message
    assert remote.committed_steps() == []


def test_ranks_promote_their_own_shares_and_rank_zero_commits(tmp_path, s3_bucket, s3_options):
    store = torch.distributed.HashStore()
    states = {rank: {"frozen": model_state(0)["frozen"], "own": torch.full((1000,), float(rank))} for rank in (0, 1)}

    def save(rank: int) -> None:
        with override(chunk_bytes=SMALL_CHUNK), ckptd.CheckpointManager(
                tmp_path / "shared", rank=rank, world_size=2, store=store, capture_rng=False) as manager:
            manager.save(7, states[rank])

    threads = [threading.Thread(target=save, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    from ckptd.tiers.local import LocalTier

    local, remote = LocalTier(tmp_path / "shared"), object_tier(s3_bucket, s3_options)
    reports = {}
    rank_zero_uploaded = threading.Event()

    def on_phase(phase: str) -> None:
        if phase == "verified":
            rank_zero_uploaded.set()

    def promote_rank_zero() -> None:
        reports[0] = Promoter(local, remote, on_phase=on_phase).promote(7, ranks=[0])

    committer = threading.Thread(target=promote_rank_zero)
    committer.start()
    assert rank_zero_uploaded.wait(60)
    assert remote.committed_steps() == [], "rank 0 waits for rank 1 before committing"
    reports[1] = Promoter(local, remote).promote(7, ranks=[1])
    committer.join(60)
    assert remote.committed_steps() == [7]
    assert list(verify_step(remote, 7)) == []
    frozen_bytes = states[0]["frozen"].numel() * 4
    assert reports[0].bytes_uploaded > frozen_bytes
    assert reports[1].bytes_uploaded < 0.1 * frozen_bytes, "rank 1 does not upload the frozen part again"
    assert remote.exists(step_file(7, "rank-00001.promoted"))
