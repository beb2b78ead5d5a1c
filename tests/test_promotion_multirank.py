"""Promotion by real gloo ranks: each rank's process uploads its own files to the S3 endpoint in the
background, rank 0 commits the remote step after every rank's share arrived, and ranks on a node whose
local tier is empty restore the saved bytes from S3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.format.layout import step_file
from ckptd.stepio.step_reader import verify_step
from ckptd.testing import run_multirank
from test_multirank_manager import _rank_state, _tensor_bytes
from test_promotion_support import object_tier

pytestmark = pytest.mark.multirank
POLICY = ckptd.Policy(keep_local=None, remote_every_steps=1)


def _save_two_steps(rank: int, world_size: int, local: str, remote: str, options: dict[str, Any]) -> dict[str, bytes]:
    state = _rank_state(rank)
    with ckptd.CheckpointManager(local, remote=remote, storage_options=options, policy=POLICY) as manager:
        assert manager.save(1, state)
        manager.wait_uploads()  # else step 2's commit supersedes step 1 before its upload starts (by design)
        with torch.no_grad():
            for parameter in state["model"].parameters():
                parameter.mul_(-2.0)
        state["buffer"].add_(rank + 5)
        assert manager.save(2, state)
        expected = _tensor_bytes(state)
    return expected  # closing waited for the writes and the uploads


def _restore_from_s3(rank: int, world_size: int, empty: str, remote: str,
                     options: dict[str, Any]) -> tuple[int | None, str | None, dict[str, bytes]]:
    fresh = _rank_state(world_size + 11)
    fresh["step_info"] = {}
    with ckptd.CheckpointManager(empty, remote=remote, storage_options=options, policy=POLICY) as manager:
        step = manager.restore(fresh)
        tier = manager.last_restore.tier if manager.last_restore else None
    return step, tier, _tensor_bytes(fresh)


@pytest.mark.slow
def test_ranks_in_separate_processes_promote_and_restore_from_s3(tmp_path: Path, s3_bucket: str,
                                                                 s3_options: dict[str, Any]) -> None:
    remote = object_tier(s3_bucket, s3_options, prefix="multirank")
    saved = run_multirank(_save_two_steps, 2, str(tmp_path / "node"), remote.url, s3_options, timeout_s=180)

    assert remote.committed_steps() == [1, 2]
    for step in (1, 2):
        assert list(verify_step(remote, step)) == []
        for rank in (0, 1):
            assert remote.exists(step_file(step, f"rank-{rank:05d}.promoted"))

    restored = run_multirank(_restore_from_s3, 2, str(tmp_path / "empty"), remote.url, s3_options, timeout_s=180)
    for rank in (0, 1):
        step, tier, values = restored[rank]
        assert step == 2 and tier is not None and tier.startswith("object"), (step, tier)
        assert values == saved[rank], f"rank {rank} restored other bytes than it saved"
