"""A node lost before any of its steps left it (no copy on a peer or the object store): the restore says
which rank has nothing to restore, on which tiers it looked, and what to do (soak finding F4; before, the
message was "no step is intact on every rank: " and nothing more)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank


def _save(rank: int, world_size: int, roots: list[str]) -> None:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    for step in (1, 2):
        assert manager.save(step, {"weights": torch.full((64,), float(10 * rank + step))})
    manager.wait()
    manager.close()


def _restore(rank: int, world_size: int, roots: list[str]) -> dict[str, str | None]:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    try:
        with pytest.raises(ckptd.NoIntactCheckpointError) as caught:
            manager.restore({"weights": torch.zeros(64)})
    finally:
        manager.close()
    return {"message": str(caught.value), "hint": caught.value.hint}


def test_a_rank_whose_node_lost_every_step_is_named_with_its_tiers_and_what_to_do(tmp_path: Path) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_multirank(_save, 2, roots, timeout_s=120)
    shutil.rmtree(roots[1])  # node 1 is lost with its disk; a replacement starts on an empty one
    Path(roots[1]).mkdir()
    outcomes = run_multirank(_restore, 2, roots, timeout_s=120)
    for outcome in outcomes:  # every rank says the same
        message, hint = outcome["message"], outcome["hint"] or ""
        assert "rank 0: step(s) 1, 2 to try" in message, message
        assert "rank 1: no intact committed step on any tier it tried (" in message, message
        assert "node1" in message.split("rank 1:", 1)[1], "the tier rank 1 tried is named"
        assert "rank 1 found no intact copy" in hint and "start the job fresh" in hint, hint
