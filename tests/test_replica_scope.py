"""Where no tier reaches every rank's files (one local directory per "node", no object or peer tier), the
default writes each replica once per directory: every node's directory holds one whole copy of its ranks'
state, the two ranks of a node share the writing, and a fresh job restores bit for bit without S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.stepio.step_reader import load_step_manifest
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier
from test_replica_ddp import STEP, WORLD, _restore, _save, _written

pytestmark = pytest.mark.multirank


def test_without_a_shared_tier_each_directory_gets_one_copy(tmp_path: Path) -> None:
    roots = [str(tmp_path / f"node{rank // 2}") for rank in range(WORLD)]
    saved = run_multirank(_save, WORLD, roots, None, {}, None, timeout_s=120)
    one_replica = sum(len(value) for value in saved[0].values())
    for node in (0, 1):
        here = _written(tmp_path / f"node{node}")
        names = [name for by_name in here.values() for name in by_name]
        assert len(names) == len(set(names)), f"node {node}: a replica written twice in one directory"
        per_rank = [sum(by_name.values()) for by_name in here.values()]
        assert sum(per_rank) == one_replica and min(per_rank) > 0, f"node {node}: {per_rank}"
        pieces = load_step_manifest(LocalTier(tmp_path / f"node{node}"), STEP).layout.replicated
        assert {piece.holders for piece in pieces} == {(0, 1), (2, 3)}, "holders stay within a directory"

    restored = run_multirank(_restore, WORLD, roots, None, {}, timeout_s=120)
    for rank, result in enumerate(restored):
        assert result["step"] == STEP and result["bytes"] == saved[0], f"rank {rank}"
        assert all(label.startswith("local") for label in result["chunks_by_tier"]), result["chunks_by_tier"]

