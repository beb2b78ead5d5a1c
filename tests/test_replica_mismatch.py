"""Holders of a replicated piece that hold different tensors (real gloo processes): the layout marks ``model``
replicated over ``dp``, but the two ranks hold it with other dtypes (same bytes, so both plan the same
writer). One copy cannot restore both, so the step is refused at commit, naming the tensor and both ranks,
and the step committed before it stays restorable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.errors import CkptdError
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

LAYOUT = ckptd.Layout(mesh={"dp": 2}, replicated=("dp",))


def _weights(dtype: torch.dtype) -> dict[str, Any]:
    return {"model": {"w": torch.arange(16, dtype=dtype).reshape(4, 4), "b": torch.full((4,), 3.0)}}


def _save_mismatched(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = ckptd.CheckpointManager(root, layout=LAYOUT, capture_rng=False)
    failure = None
    try:
        assert manager.save(1, _weights(torch.float32), force=True)
        manager.wait()
        assert manager.save(2, _weights(torch.float32 if rank == 0 else torch.int32), force=True)
        try:
            manager.wait()
        except CkptdError as error:
            failure = str(error)
    finally:
        try:
            manager.close()
        except CkptdError as error:
            failure = failure or str(error)
    live = {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}}
    with ckptd.CheckpointManager(root, layout=LAYOUT, capture_rng=False) as manager:
        restored = manager.restore(live)
    return {"failure": failure, "restored": restored, "w": live["model"]["w"].tolist()}


def test_holders_of_a_replicated_piece_with_other_dtypes_are_refused_at_commit(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_multirank(_save_mismatched, 2, root, timeout_s=90)
    for rank, result in enumerate(results):
        assert result["failure"] is not None, f"rank {rank}: the step with mismatched holders was committed"
        assert "'model/w'" in result["failure"] and "int32[4, 4]" in result["failure"] \
            and "float32[4, 4]" in result["failure"], result["failure"]
        assert result["restored"] == 1, "the step committed before is kept and restored"
        assert result["w"] == torch.arange(16, dtype=torch.float32).reshape(4, 4).tolist()
    assert sorted(LocalTier(root).committed_steps()) == [1]
