"""Replicas written once with one local directory per "node" (two gloo ranks each) and moto's S3 as the
object tier: each node's directory holds its own ranks' shares, the ranks of each node find the pieces the
other node wrote on the object tier, bit for bit; without the object tier the restore names the piece that
no tier it reads holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptd.testing import run_multirank

from test_promotion_support import object_tier
from test_replica_ddp import STEP, WORLD, _restore, _save, _written, mismatch

pytestmark = pytest.mark.multirank


@pytest.mark.slow
def test_node_roots_find_the_other_nodes_pieces_on_the_object_tier(tmp_path: Path, s3_bucket: str,
                                                                   s3_options: dict[str, Any]) -> None:
    roots = [str(tmp_path / f"node{rank // 2}") for rank in range(WORLD)]
    remote = object_tier(s3_bucket, s3_options, prefix="ddp").url
    saved = run_multirank(_save, WORLD, roots, remote, s3_options, "once", timeout_s=150)
    for node in (0, 1):
        here = _written(Path(tmp_path / f"node{node}"))
        assert set(here) == {2 * node, 2 * node + 1}, "each node directory holds its own ranks' shares"

    restored = run_multirank(_restore, WORLD, roots, remote, s3_options, timeout_s=150)
    for rank, result in enumerate(restored):
        assert result["step"] == STEP, f"rank {rank}: {result}"
        assert not mismatch(result["bytes"], saved[0]), f"rank {rank}: {mismatch(result['bytes'], saved[0])}"
    from_s3 = [sum(n for label, n in r["chunks_by_tier"].items() if label.startswith("object")) for r in restored]
    assert all(from_s3), f"every rank reads the other node's pieces from S3: {from_s3}"

    alone = run_multirank(_restore, WORLD, roots, None, {}, timeout_s=150)
    for rank, result in enumerate(alone):
        assert "is a replica that rank" in result["error"], f"rank {rank}: {result}"
        assert "remote=" in result["error"], "the error says which tier would hold it"
