"""Every rank decides alike whether a restore reshards (real gloo processes): a resharded restore calls
``dcp.load``, whose collectives wait for every rank, so a rank that decided otherwise would leave the
others waiting. Pipeline stages hold DTensors of different names on their own sub-meshes: the manifest's
placements are rank 0's view, so only some ranks see that the sharding changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptd
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank

STEP = 3


def _stage_weight(stage: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(40 + stage))


def _stage_state(rank: int, placement: Any, *, empty: bool) -> dict[str, Any]:
    """Stage ``rank // 2`` of a (pp=2, dp=2) mesh: its layer, a DTensor on the stage's own dp sub-mesh."""
    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    full = torch.zeros(8, 6) if empty else _stage_weight(stage)
    return {"model": {f"layers.{stage}.weight": distribute_tensor(full, mesh, [placement])}}


def _save(rank: int, world_size: int, root: str) -> None:
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.save(STEP, _stage_state(rank, Shard(0), empty=False), force=True)


def _restore(rank: int, world_size: int, root: str, changed_stage: int) -> dict[str, Any]:
    placement = Replicate() if rank // 2 == changed_stage else Shard(0)
    state = _stage_state(rank, placement, empty=True)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == STEP
        resharded = manager.last_restore.resharded
    weight = state["model"][f"layers.{rank // 2}.weight"].full_tensor()
    return {"bytes": weight.view(torch.uint8).numpy().tobytes(), "resharded": resharded}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("decision") / "ckpt")
    run_multirank(_save, 4, root, timeout_s=90)
    return root


@pytest.mark.parametrize("changed_stage", [0, 1], ids=["stage0-changed", "stage1-changed"])
def test_a_sharding_change_that_one_stage_sees_reshards_on_every_rank(saved_root: str, changed_stage: int) -> None:
    restored = run_multirank(_restore, 4, saved_root, changed_stage, timeout_s=60)
    assert [r["resharded"] for r in restored] == [True] * 4, "the ranks decided alike"
    for rank, result in enumerate(restored):
        assert result["bytes"] == _stage_weight(rank // 2).view(torch.uint8).numpy().tobytes(), f"rank {rank}"
