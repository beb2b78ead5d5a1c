"""The default ``write_replicas`` with one local directory per "node" and an object tier that gets only
every other step (``remote_every_steps=2``, moto's S3): every node's directory keeps its ranks' whole
state, so the newest step, on local disks only, restores bit for bit after the job restarts (with replicas
written once across nodes it needed the other node's directory, and the restore fell back to an older step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckptd
from ckptd.testing import run_multirank

from test_promotion_support import object_tier
from test_replica_ddp import WORLD, _bytes, _fresh, _trained

pytestmark = pytest.mark.multirank

POLICY = ckptd.Policy(keep_local=None, remote_every_steps=2)
LAST = 3


def _layout(world_size: int) -> ckptd.Layout:
    return ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))


def _save_steps(rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any]) -> dict[str, bytes]:
    model, optimizer = _trained()
    state = {"model": model, "optim": optimizer}
    with ckptd.CheckpointManager(roots[rank], layout=_layout(world_size), remote=remote, storage_options=options,
                                 policy=POLICY, codec="raw") as manager:
        for step in range(1, LAST + 1):
            assert manager.save(step, state, force=True)
    return _bytes(state)


def _restore_newest(rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any]) -> dict[str, Any]:
    state = _fresh()
    with ckptd.CheckpointManager(roots[rank], layout=_layout(world_size), remote=remote, storage_options=options,
                                 policy=POLICY) as manager:
        step = manager.restore(state)
        tiers = dict(manager.last_restore.chunks_by_tier)
    return {"step": step, "bytes": _bytes(state), "chunks_by_tier": tiers}


def test_node_directories_restore_the_newest_local_step_with_an_object_tier(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    roots = [str(tmp_path / f"node{rank // 2}") for rank in range(WORLD)]
    remote = object_tier(s3_bucket, s3_options, prefix="defaults").url
    saved = run_multirank(_save_steps, WORLD, roots, remote, s3_options, timeout_s=150)
    restored = run_multirank(_restore_newest, WORLD, roots, remote, s3_options, timeout_s=150)
    for rank, result in enumerate(restored):
        assert result["step"] == LAST, f"rank {rank} restored step {result['step']}, not the newest local one"
        assert result["bytes"] == saved[0], f"rank {rank}"
        assert all(label.startswith("local") for label in result["chunks_by_tier"]), result["chunks_by_tier"]
